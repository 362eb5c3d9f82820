"""The plan channel: the scheduler's `StepPlan` deltas to the gpu worker, and the worker's
reports back (`PlanEnding`, `StepDone`, `WorkerReady`).

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem_serve.proto.adapter_messages import AdapterLoad
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import ImageInput, SamplingParams


@dataclass
class NewRequest:
    """A request the worker has no state for, or one resuming after preemption."""

    request_id: int
    prompt_ids: np.ndarray  # int32; empty when resuming (the worker kept the history)
    sampling: SamplingParams | None  # None when resuming
    block_ids: list[int]
    num_cached_tokens: int  # prefix-cache hit: KV already in the first blocks
    num_prefill_tokens: int  # how many history tokens to prefill in this plan (a chunk)
    resume: bool = False
    lora_slot: int = 0  # the adapter slot its rows use (0: none; kept while preempted)
    # The chunk's tokens per step of the plan (the rule is in StepPlan's docstring).
    prefill_steps: list[int] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)  # a new request's (not a resume's)


@dataclass
class ContinueRequest:
    """A running request that needs more blocks or its next prefill chunk."""

    request_id: int
    new_block_ids: list[int]
    num_prefill_tokens: int = 0
    prefill_steps: list[int] = field(default_factory=list)  # as in NewRequest


@dataclass
class StepPlan:
    """The deltas for one multi-step plan; requests not named keep decoding.

    Each of the K steps is one forward over every decoding row (one token each) and the
    prefill chunk pieces the plan puts in that step.  A request's `prefill_steps[s]` is how
    many tokens of its chunk step s computes; the list ends with the step of its last piece,
    and a chunk that completes the prompt starts decoding in that same step (its decode row
    reads the piece's KV, written earlier in the same forward).  Empty: the whole chunk in
    step 0.  With `prefill_phase` (the baseline) every chunk runs in one forward of its own
    before step 0 instead, and the requests it completes decode from step 0.
    """

    plan_id: int
    num_steps: int
    new: list[NewRequest] = field(default_factory=list)
    cont: list[ContinueRequest] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)  # finished or aborted: forget everything
    preempt: list[int] = field(default_factory=list)  # free the KV, keep the token history
    publish_per_step: bool = True  # async mode; sync mode publishes after the last step
    # Guided decoding: constraints the worker does not hold yet and that requests of this plan
    # use (each sent once, not per request), and ids it may forget (no request uses them).
    tables: list[GuidedTable | GuidedGrammar] = field(default_factory=list)
    drop_tables: list[str] = field(default_factory=list)
    # LoRA adapters to load before this plan's forwards (into slots no running request uses).
    adapters: list[AdapterLoad] = field(default_factory=list)
    prefill_phase: bool = False
    # The host KV tier (`scheduler/kv/host_tier.py`), before anything else of the plan: device
    # block offload_blocks[i] is copied to host slot offload_slots[i] (its content is final:
    # earlier plans wrote it; this plan may reuse it), then host slot onload_slots[i] to
    # device block onload_blocks[i] (a request of this plan takes it as computed).
    offload_blocks: list[int] = field(default_factory=list)
    offload_slots: list[int] = field(default_factory=list)
    onload_slots: list[int] = field(default_factory=list)
    onload_blocks: list[int] = field(default_factory=list)


@dataclass
class PlanEnding:
    """Plan `plan_id` has about `--plan-lead-ms` of work left (async mode, paced planning).

    The scheduler builds the next plan now rather than the moment this one was sent, so a
    request that arrived while this plan ran joins the very next one; the lead covers
    building, sending and applying it, so the worker still never waits.
    """

    plan_id: int


@dataclass
class StepDone:
    """A plan ended: how many tokens each request got and which ones finished."""

    plan_id: int
    request_ids: np.ndarray  # int64
    num_tokens: np.ndarray  # int32, tokens produced in this plan
    finished_ids: np.ndarray  # int64
    finish_reasons: np.ndarray  # uint8
    forward_time: float  # seconds the plan's forwards took (metrics)
    wall_time: float
    # Seconds the worker waited for this plan after finishing the previous one, and whether
    # the plan only continued decoding (no prefill): the device-idle share in steady decode.
    idle_time: float = 0.0
    decode_only: bool = False
    # Speculative decoding in this plan: row-steps that had a draft, draft tokens proposed,
    # draft tokens accepted (the vLLM counters tandem_spec_decode_*).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] = field(default_factory=list)  # by draft position


@dataclass
class WorkerReady:
    """Start-up handshake: the model is loaded and the KV cache allocated."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    # LongRoPE (Phi-3): a history longer than this is rotated with other factors, so KV of
    # the same prompt tokens differs with the request's length; 0: no such model.
    long_rope_from: int = 0
    device_type: str = ""  # "cpu", "cuda": picks the default per-step token budget
    # Context length at which a prefill token's attention costs what the rest of its
    # forward does (0: unknown); the scheduler's per-step budget weighs pieces by it.
    attention_tokens: int = 0
    # Blocks of the host KV tier each rank holds (0: no tier; `--kv-offloading-size`).
    num_host_blocks: int = 0
    # A hybrid model's linear layers keep a recurrent state per request, which a cached
    # prefix's KV blocks restore only at a block the worker checkpointed the state at: every
    # `state_checkpoint_blocks`-th block of a prompt (0: none; the scheduler then serves no
    # prefix hits), so a hit ends at a multiple of that many blocks.
    recurrent_state: bool = False
    state_checkpoint_blocks: int = 0
