"""Every internal message, one dataclass per kind.

Requests are named by a 64-bit integer id that the frontend assigns; the gRPC layer keeps
the mapping to client streams and correlation ids. Integer ids let token batches travel as
plain numpy arrays, and `request_id % num_postproc_workers` picks the owning postproc worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from tandem_serve.proto.adapter_messages import AdapterFailed, AdapterLoad
from tandem_serve.proto.monitor_messages import (
    EngineStats,
    Heartbeat,
    PostprocStats,
    ProfileControl,
    ProfileData,
)


class FinishReason(IntEnum):
    """Why a request ended; the numbers are the public `fmaas.StopReason` values."""

    NOT_FINISHED = 0
    MAX_TOKENS = 1
    EOS_TOKEN = 2
    CANCELLED = 3
    TIME_LIMIT = 4
    STOP_SEQUENCE = 5
    TOKEN_LIMIT = 6
    ERROR = 7


class GuidedKind(IntEnum):
    """How a request's output is constrained (guided decoding)."""

    NONE = 0
    TABLE = 1  # regex, choice, JSON schema, any JSON object: an automaton stepped on the device
    GRAMMAR = 2  # a context-free grammar: matched on the gpu worker's host, a bitmask per step


@dataclass
class SamplingParams:
    """What the gpu worker needs to pick tokens and to know when a request is done."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    typical_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    # OpenAI's penalties over the output so far: logit -= frequency * count + presence * seen.
    frequency_penalty: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    seed: int = 0
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids plus request stop ids
    length_penalty_start: int = 0
    length_penalty_decay: float = 1.0  # 1 = off
    logprobs: bool = False  # chosen token's logprob and rank
    top_n: int = 0  # alternatives per token (<= 10)
    prompt_logprobs: bool = False  # logprob/rank/top-n of every prompt token (no prefix cache)
    # Guided decoding: the constraint's kind and content id (GuidedTable.table_id or
    # GuidedGrammar.grammar_id).  The request carries only these: the table itself travels
    # on its own, once per id on each hop (frontend -> scheduler -> gpu worker).
    guided_kind: GuidedKind = GuidedKind.NONE
    guided_id: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class OutputOptions:
    """What the postproc worker needs to turn ids into the response a client asked for."""

    stop_sequences: list[str] = field(default_factory=list)
    include_stop_sequence: bool = True
    skip_special_tokens: bool = True
    token_details: bool = False  # TokenInfo per generated token
    logprobs: bool = False
    ranks: bool = False
    top_n: int = 0


# ---------------------------------------------------------------- guided decoding


@dataclass
class GuidedTable:
    """A regular constraint (regex, choice, JSON schema, any JSON object) compiled to a token
    automaton, which the gpu worker steps on the device (`guided/`,
    `gpu_worker/constrain/tables.py`).

    States 0..S-1 are the automaton's; row S of `next_state` is DONE. Tokens that behave the
    same in every state share a class. The EOS ids' class is allowed only in final states and
    leads to DONE; DONE allows only EOS, so a row always has a legal token, and a final state
    with no other continuation forces EOS.
    """

    table_id: str  # content hash of (constraint, tokenizer, vocab size, format version)
    next_state: np.ndarray  # int32 [S + 1, C]: next state, -1 = class not allowed
    token_class: np.ndarray  # int32 [V], V = the model's vocab size
    initial_state: int = 0


@dataclass
class GuidedGrammar:
    """A context-free grammar, matched with llguidance on the gpu worker's host."""

    grammar_id: str  # content hash of (grammar, tokenizer, format version)
    lark: str  # the grammar in llguidance's Lark dialect (GBNF converted by the frontend)


@dataclass
class GuidedWanted:
    """Scheduler -> frontend: send these constraints' tables (again): requests name them,
    and neither the scheduler nor the gpu worker holds them (never sent to this scheduler,
    or dropped at the worker while a request waited)."""

    guided_ids: list[str]


@dataclass
class GuidedLost:
    """Frontend -> scheduler: a wanted constraint cannot be had; the requests that name it
    fail with `message`."""

    guided_id: str
    message: str


# ---------------------------------------------------------------- frontend -> scheduler


@dataclass
class AddRequest:
    request_id: int
    prompt_ids: np.ndarray  # int32
    sampling: SamplingParams
    arrival_time: float  # time.monotonic() of the frontend when the RPC arrived
    # The compiled constraint named by sampling.guided_id, when the sender puts it in the
    # request.  The frontend never does (None): it sends each table as a message of its own,
    # once per id, and again when the scheduler asks (`GuidedWanted`).
    guided: GuidedTable | GuidedGrammar | None = None
    adapter_id: str = ""  # a LoRA adapter the frontend validated ("": the base model)


@dataclass
class AbortRequest:
    request_id: int
    reason: FinishReason = FinishReason.CANCELLED


# ---------------------------------------------------------------- scheduler -> frontend


@dataclass
class RequestRejected:
    """Admission control said no; the frontend answers RESOURCE_EXHAUSTED."""

    request_id: int
    message: str


@dataclass
class RequestFailed:
    """The scheduler ended a request that no token will ever finish (e.g. cannot fit)."""

    request_id: int
    reason: FinishReason
    message: str
    # A gRPC status name when the request fails as an error (e.g. INVALID_ARGUMENT: its
    # adapter could not be loaded) rather than ending with `reason`.
    code: str = ""


# ---------------------------------------------------------------- frontend -> postproc


@dataclass
class RegisterRequest:
    """Sent to the owning postproc worker before the request reaches the scheduler."""

    request_id: int
    prompt_ids: np.ndarray  # int32; context for the detokenizer's first tokens
    options: OutputOptions
    max_new_tokens: int


@dataclass
class ForgetRequest:
    """The request ended outside the token stream (cancel, time limit); drop its state."""

    request_id: int


# ---------------------------------------------------------------- scheduler -> gpu worker


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


# ---------------------------------------------------------------- gpu worker -> postproc


@dataclass
class TokenBatch:
    """One step's sampled tokens.  Rows whose token is -1 were masked (finished earlier, or
    still prefilling: a row starts decoding at the step of its last prefill piece)."""

    plan_id: int
    step: int
    request_ids: np.ndarray  # int64 [B]
    token_ids: np.ndarray  # int32 [B]
    finish: np.ndarray  # uint8 [B], FinishReason known on the device (EOS, stop id, limits)
    logprobs: np.ndarray | None = None  # float32 [B]
    ranks: np.ndarray | None = None  # int32 [B]
    top_ids: np.ndarray | None = None  # int32 [B, n]
    top_logprobs: np.ndarray | None = None  # float32 [B, n]
    last: bool = False  # the plan's last batch: postproc reports PlanProcessed after it


@dataclass
class PromptDetail:
    """Logprobs of prompt tokens [start, start + n) given their prefix, from a prefill.

    Position 0 has no prefix, so the first chunk starts at 1.  Chunked prefill sends several.
    """

    request_id: int
    start: int
    token_ids: np.ndarray  # int32 [n], the prompt tokens these rows score
    logprobs: np.ndarray  # float32 [n]
    ranks: np.ndarray  # int32 [n]
    top_ids: np.ndarray | None = None  # int32 [n, k]
    top_logprobs: np.ndarray | None = None  # float32 [n, k]
    last: bool = False  # the whole prompt has been scored


# ---------------------------------------------------------------- gpu worker -> scheduler


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


# ---------------------------------------------------------------- postproc -> scheduler


@dataclass
class StopHit:
    """A stop string ended the request after `num_tokens` generated tokens."""

    request_id: int
    num_tokens: int


@dataclass
class PlanProcessed:
    plan_id: int
    worker_index: int
    busy_s: float = 0.0  # time this worker spent on the plan's batches (metrics)


# ---------------------------------------------------------------- postproc -> frontend


@dataclass
class OutputDelta:
    request_id: int
    text: str
    num_generated: int  # cumulative
    token_ids: list[int] = field(default_factory=list)  # ids behind this delta
    token_texts: list[str] | None = None
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_texts: list[list[str]] | None = None
    top_logprobs: list[list[float]] | None = None
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    stop_sequence: str = ""
    # Input-token detail, once, before the first generated token (when asked).
    prompt_logprobs: list[float] | None = None  # one per prompt token; NaN for the first
    prompt_ranks: list[int] | None = None
    prompt_top_texts: list[list[str]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None


@dataclass
class OutputBatch:
    """All deltas a postproc worker produced for one step, sent as one message."""

    deltas: list[OutputDelta]


# ---------------------------------------------------------------- control


@dataclass
class Shutdown:
    reason: str = ""


@dataclass
class Ready:
    """A child process reports that its sockets are up."""

    role: str
    index: int = 0


@dataclass
class WorkerHung:
    """Scheduler -> launcher: plan `plan_id` has been running `seconds`, past step_timeout."""

    plan_id: int
    seconds: float
    role: str = "gpu-worker"


@dataclass
class ProcessFailed:
    """A child -> launcher: this process is dying of an exception (sent as it unwinds)."""

    role: str
    pid: int
    error: str  # "ExceptionType: message", shortened; a start-up mistake's message alone
    peer_died: bool = False  # the error says another process died: a consequence, not a cause
    # A mistake in how the server was started (a model it cannot load, a device it lacks):
    # the launcher prints the message as one line and exits 2 (`ipc.process.StartupError`).
    startup: bool = False


MESSAGE_TYPES: tuple[type, ...] = (
    SamplingParams,
    OutputOptions,
    AddRequest,
    AbortRequest,
    RequestRejected,
    RequestFailed,
    RegisterRequest,
    ForgetRequest,
    NewRequest,
    ContinueRequest,
    StepPlan,
    TokenBatch,
    PromptDetail,
    StepDone,
    WorkerReady,
    StopHit,
    PlanProcessed,
    OutputDelta,
    OutputBatch,
    Shutdown,
    Ready,
    WorkerHung,  # appended: indices of the types above must not move
    EngineStats,
    ProcessFailed,
    Heartbeat,
    ProfileControl,
    ProfileData,
    PostprocStats,
    PlanEnding,
    GuidedTable,
    GuidedGrammar,
    AdapterLoad,
    AdapterFailed,
    GuidedWanted,
    GuidedLost,
)
