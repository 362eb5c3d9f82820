"""Hands each step's tokens to the postproc channel without stalling the device.

On CUDA the step's tensors are copied into pinned host buffers with `non_blocking=True`
and a CUDA event is recorded; a publisher thread waits on that event (not the stream) and
then writes the `TokenBatch`, so the next step's kernels are already queued when the copy
lands.  On CPU the tensors are already in host memory and go out at once.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import numpy as np
import torch

from gpu_worker.batch import DecodeBatch, StepTensors
from proto.messages import StepPlan, TokenBatch

Sink = Callable[[TokenBatch], None]


def _np(t: torch.Tensor | None, dtype: type) -> np.ndarray | None:
    return None if t is None else t.numpy().astype(dtype, copy=False)


def to_token_batch(plan: StepPlan, request_ids: np.ndarray, st: StepTensors,
                   last: bool) -> TokenBatch:
    return TokenBatch(
        plan_id=plan.plan_id, step=st.step, request_ids=request_ids,
        token_ids=st.token_ids.numpy().astype(np.int32),
        finish=st.finish.numpy(), logprobs=_np(st.logprobs, np.float32),
        ranks=_np(st.ranks, np.int32), top_ids=_np(st.top_ids, np.int32),
        top_logprobs=_np(st.top_logprobs, np.float32), last=last)




class TokenPublisher:
    def __init__(self, sink: Sink, device: torch.device) -> None:
        self._sink = sink
        self._cuda = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        if self._cuda:
            self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
            self._thread.start()

    def __call__(self, plan: StepPlan, batch: DecodeBatch, st: StepTensors, last: bool) -> None:
        if not self._cuda:
            self._sink(to_token_batch(plan, batch.request_ids, st, last))
            return
        host = StepTensors(st.step, *[_pinned_copy(t) for t in (
            st.token_ids, st.finish, st.logprobs, st.ranks, st.top_ids, st.top_logprobs)])
        event = torch.cuda.Event()
        event.record()
        self._queue.put((plan, batch.request_ids, host, last, event))

    def end_of_plan(self, plan: StepPlan) -> None:
        """Marker for a plan without decode rows, so postproc still reports PlanProcessed."""
        msg = TokenBatch(plan.plan_id, -1, np.zeros(0, dtype=np.int64),
                         np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint8), last=True)
        if self._cuda:
            self._queue.put(msg)
        else:
            self._sink(msg)

    def flush(self) -> None:
        """Wait until everything queued has been written (end of plan)."""
        if self._cuda:
            self._queue.join()
        if self._error is not None:
            raise RuntimeError("token publisher failed") from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, TokenBatch):
                    self._sink(item)
                else:
                    plan, rids, host, last, event = item
                    event.synchronize()
                    self._sink(to_token_batch(plan, rids, host, last))
            except BaseException as exc:  # surfaced to the main loop by flush()
                self._error = exc
            finally:
                self._queue.task_done()


def _pinned_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
