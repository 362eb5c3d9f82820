"""Hands each step's tokens to the postproc channel without stalling the device.

Calling the publisher inside the K-step loop only *queues* the step: on CUDA its tensors are
copied into pinned host buffers with `non_blocking=True` and a CUDA event is recorded; on
CPU the step's tensors are queued as they are.  A publisher thread then turns each queued
step into a `TokenBatch` and writes it to the sink, so nothing in the loop reads a device
value (`forbid_host_sync()` checks this in the tests) and the next step's work is already
under way while a step is written out:

* on CUDA the thread waits on the copy's event (not on the stream), then reads the pinned
  buffers;
* on CPU there is no asynchronous stream: an op has finished computing when its Python call
  returns, so the queued tensors are complete and the thread's `.numpy()` reads finished
  memory, waiting for nothing.  Those tensors are never written again (every step makes new
  ones), so the read cannot race the loop.

Prompt detail goes through the same queue, so the sink sees every message in the order the
runner produced it: as host messages (`send_detail`), or as scores still on the device
(`send_scores`, from a step's prefill pieces) that the thread reads like a step's tokens.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors
from tandem_serve.proto.plan_messages import StepPlan
from tandem_serve.proto.token_messages import PromptDetail, TokenBatch

Message = TokenBatch | PromptDetail
Sink = Callable[[Message], None]
# Host arrays of queued device scores -> the messages they make.
MakeDetails = Callable[[list[np.ndarray]], list[PromptDetail]]


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


class _Step:
    """A queued step: host-readable tensors once `event` (CUDA only) has fired."""

    __slots__ = ("plan", "request_ids", "host", "last", "event")

    def __init__(self, plan: StepPlan, request_ids: np.ndarray, host: StepTensors, last: bool,
                 event: torch.cuda.Event | None) -> None:
        self.plan, self.request_ids, self.host, self.last, self.event = (
            plan, request_ids, host, last, event)


class _Scores:
    """Queued prompt scores: host-readable once `event` (CUDA only) has fired."""

    __slots__ = ("host", "make", "event")

    def __init__(self, host: list[torch.Tensor], make: MakeDetails,
                 event: torch.cuda.Event | None) -> None:
        self.host, self.make, self.event = host, make, event


_STOP = object()


class TokenPublisher:
    def __init__(self, sink: Sink, device: torch.device) -> None:
        self._sink = sink
        self._cuda = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def __call__(self, plan: StepPlan, batch: DecodeBatch, st: StepTensors, last: bool) -> None:
        """Queue one step; reads no device value (safe inside the K-step loop)."""
        event = None
        host = st
        if self._cuda:
            host = StepTensors(st.step, _pinned(st.token_ids), _pinned(st.finish),
                               _pinned_copy(st.logprobs), _pinned_copy(st.ranks),
                               _pinned_copy(st.top_ids), _pinned_copy(st.top_logprobs))
            event = torch.cuda.Event()
            event.record()
        self._queue.put(_Step(plan, batch.request_ids, host, last, event))

    def send_detail(self, msg: PromptDetail) -> None:
        """Queue a prefill's prompt detail behind everything queued before it."""
        self._queue.put(msg)

    def send_scores(self, scores: list[torch.Tensor], make: MakeDetails) -> None:
        """Queue prompt scores still on the device; reads nothing (safe inside the loop)."""
        event = None
        if self._cuda:
            scores = [_pinned(t) for t in scores]
            event = torch.cuda.Event()
            event.record()
        self._queue.put(_Scores(scores, make, event))

    def end_of_plan(self, plan: StepPlan) -> None:
        """Marker for a plan without decode rows, so postproc still reports PlanProcessed."""
        self._queue.put(TokenBatch(plan.plan_id, -1, np.zeros(0, dtype=np.int64),
                                   np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint8),
                                   last=True))

    def flush(self) -> None:
        """Wait until everything queued has been written (end of plan)."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError("token publisher failed") from self._error

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Scores):
                    if item.event is not None:
                        item.event.synchronize()
                    for detail in item.make([t.numpy() for t in item.host]):
                        self._sink(detail)
                    continue
                if isinstance(item, _Step):
                    if item.event is not None:
                        item.event.synchronize()
                    item = to_token_batch(item.plan, item.request_ids, item.host, item.last)
                self._sink(item)
            except BaseException as exc:  # surfaced to the main loop by flush()
                self._error = exc
            finally:
                self._queue.task_done()


def _pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _pinned_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _pinned(t)


def publish_step(publish: TokenPublisher, plan: StepPlan, batch: DecodeBatch, st: StepTensors,
                 last: bool) -> None:
    """A step's prompt detail (from its prefill pieces), then its tokens: a verify step's
    [B, 1 + k] as 1 + k batches in order, -1 where a row emitted fewer."""
    if st.details is not None:
        publish.send_scores(*st.details)
    if st.token_ids.dim() == 1:
        publish(plan, batch, st, last)
        return
    width = st.token_ids.shape[1]
    for j in range(width):
        publish(plan, batch, StepTensors(
            st.step * width + j, st.token_ids[:, j], st.finish[:, j], _column(st.logprobs, j),
            _column(st.ranks, j), _column(st.top_ids, j), _column(st.top_logprobs, j)),
            last and j == width - 1)


def _column(t: torch.Tensor | None, j: int) -> torch.Tensor | None:
    return None if t is None else t[:, j]
