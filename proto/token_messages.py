"""The token path: the gpu worker's token batches to the postproc workers, their stop hits and
processed plans to the scheduler, and the assembled output to the frontend.

Requests are named by a 64-bit integer id that the frontend assigns; integer ids let token
batches travel as plain numpy arrays, and `request_id % num_postproc_workers` picks the
owning postproc worker.

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem_serve.proto.request_params import FinishReason


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
