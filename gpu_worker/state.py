"""Per-request state the gpu worker keeps across plans, on the host.

It holds what is known before a plan starts (history, block table, sampling params, guided
and adapter state); `gpu_worker.batch` moves the decoding rows to the device once per plan.
A leaf module: the batch, guided decoding and grammars all read it, and it reads none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem_serve.proto.request_params import FinishReason, ImageInput, SamplingParams


@dataclass
class RequestState:
    request_id: int
    history: list[int]  # prompt + generated, as far as the host has seen it
    num_prompt: int
    sampling: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose KV is in the cache
    prefill_chunk: int = 0  # tokens to prefill in the current plan
    prefill_steps: list[int] = field(default_factory=list)  # the chunk per step (empty: step 0)
    num_prompt_scored: int = 0  # prompt positions whose next token's logprob was sent
    finished: FinishReason = FinishReason.NOT_FINISHED
    # Guided decoding, as of the end of `history`: a table row's automaton state, a grammar
    # row's llguidance matcher (both unset while preempted: the resume replays the output).
    guided_state: int = -1
    matcher: Any = None
    lora_slot: int = 0  # the adapter slot of its rows (0: the base model)
    # Drafts accepted per verify step, as measured (< 0: not yet; gpu_worker.spec.policy).
    spec_rate: float = -1.0
    # Positions [0, draft_len) whose KV the draft model's cache holds (gpu_worker.spec.draft_model).
    draft_len: int = 0
    # A VL model's prompt images (`gpu_worker.vision`), kept until the request is dropped so
    # a resume can encode them again; M-RoPE's prompt positions [3, prompt] (None: not yet
    # computed) and the delta of the positions after the prompt.
    images: list[ImageInput] = field(default_factory=list)
    mrope: np.ndarray | None = None
    rope_delta: int = 0
    # Hybrid models: the recurrent-state slot it holds while it runs (-1: none; released
    # when preempted or dropped, see `models.hybrid.state_cache`).
    state_slot: int = -1

    @property
    def num_generated(self) -> int:
        return len(self.history) - self.num_prompt

    @property
    def decoding(self) -> bool:
        return not self.finished and self.num_computed == len(self.history) - 1
