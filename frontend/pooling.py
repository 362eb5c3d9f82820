"""The frontend's side of `--runner pooling`: submit prefill-only requests, await vectors.

Each input (a text, or a text pair for a cross-encoder) is one engine request with its own
id; `Pooler.run` sends them all to the scheduler and returns their rows in input order once
the gpu worker's `PoolOutput`s have brought every one.  A caller that goes away (an HTTP
client's disconnect) aborts the ones still queued.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import numpy as np

from tandem_serve.frontend.vllm_metrics import VllmMetrics
from tandem_serve.proto.pooling_messages import PoolOutput, PoolRequest
from tandem_serve.proto.request_messages import AbortRequest, RequestRejected

_EMPTY = np.zeros(0, dtype=np.int32)


class PoolingRejected(Exception):
    """Admission control said no (the queue is full): a 429."""


class Pooler:
    def __init__(self, send: Callable[[object], None], new_id: Callable[[], int],
                 metrics: VllmMetrics | None = None) -> None:
        self._send = send
        self._new_id = new_id
        self._metrics = metrics
        self._waiting: dict[int, asyncio.Future[np.ndarray]] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._waiting)

    async def run(self, prompts: Sequence[Sequence[int]],
                  token_types: Sequence[Sequence[int]] | None = None,
                  arrived: float | None = None, metered: bool = True) -> np.ndarray:
        """(len(prompts), dimensions) float32, one row per prompt in its order."""
        arrived = time.monotonic() if arrived is None else arrived
        loop = asyncio.get_running_loop()
        ids = [self._new_id() for _ in prompts]
        futures = [loop.create_future() for _ in prompts]
        for i, (rid, fut) in enumerate(zip(ids, futures, strict=True)):
            self._waiting[rid] = fut
            types = np.asarray(token_types[i], dtype=np.int32) if token_types else _EMPTY
            self._send(PoolRequest(rid, np.asarray(prompts[i], dtype=np.int32), types, arrived))
        try:
            rows = await asyncio.gather(*futures)
        except BaseException:  # cancelled, rejected or failed: the rest need not run
            for rid, fut in zip(ids, futures, strict=True):
                # A cancelled gather cancels the futures it waited for: those never got
                # their row either.
                if not fut.done() or fut.cancelled():
                    self._send(AbortRequest(rid))
            raise
        finally:
            for rid in ids:
                self._waiting.pop(rid, None)
        if metered and self._metrics is not None:
            self._meter(prompts, arrived)
        return np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)

    def _meter(self, prompts: Sequence[Sequence[int]], arrived: float) -> None:
        """vLLM counts a pooling request's prompt tokens and its success ("stop")."""
        m = self._metrics
        assert m is not None
        now = time.monotonic()
        for p in prompts:
            m.prompt_tokens.inc(len(p))
            m.success["stop"].inc()
            m.e2e.observe(now - arrived)

    def on_output(self, msg: PoolOutput) -> None:
        for rid, row in zip(msg.request_ids.tolist(), msg.data, strict=True):
            fut = self._waiting.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(row)

    def on_rejected(self, msg: RequestRejected) -> bool:
        """True when the rejected request was ours."""
        fut = self._waiting.get(msg.request_id)
        if fut is None:
            return False
        if not fut.done():
            fut.set_exception(PoolingRejected(msg.message))
        return True

    def fail_all(self, exc: Exception) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
