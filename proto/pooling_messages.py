"""The pooling path (`--runner pooling`): prefill-only requests whose outputs are vectors.

frontend -> scheduler `PoolRequest`; scheduler -> gpu worker `PoolPlan` (a batch under the
token budget); gpu worker -> frontend `PoolOutput` (the vectors) and -> scheduler `PoolDone`
(what ran, for the next batch and the counters).  No postproc worker sees any of them.

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PoolRequest:
    """One text (or text pair) to run through the model and pool."""

    request_id: int
    prompt_ids: np.ndarray  # int32
    token_type_ids: np.ndarray  # int32, as long as prompt_ids; empty: all zeros
    arrival_time: float  # the frontend's time.monotonic() when the HTTP request arrived


@dataclass
class PoolPlan:
    """A batch of pooling requests for one forward (prefill only, no KV kept)."""

    plan_id: int
    requests: list[PoolRequest] = field(default_factory=list)


@dataclass
class PoolOutput:
    """The plan's vectors, one row per request in the plan's order (float32, unnormalised
    cuts and activations are the frontend's: they depend on the request)."""

    request_ids: np.ndarray  # int64
    data: np.ndarray  # float32 (n, dimensions)


@dataclass
class PoolDone:
    """The worker finished a pooling plan."""

    plan_id: int
    num_requests: int
    num_tokens: int
    forward_time: float  # seconds
