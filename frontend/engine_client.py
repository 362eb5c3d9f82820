"""The frontend's side of the pipeline: submit requests, route output deltas to streams.

One asyncio task reads the frontend inbox (deltas from postproc, rejections and failures
from the scheduler, readiness) and puts each item into the queue of its request.  A
request's registration goes to its postproc worker before the request itself goes to the
scheduler, so the worker knows it before the first token can arrive.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from tandem_serve.frontend import metrics
from tandem_serve.frontend.constraints import ConstraintSender
from tandem_serve.frontend.liveness import Liveness
from tandem_serve.frontend.pooling import Pooler
from tandem_serve.frontend.stream_buffer import StreamBuffer
from tandem_serve.frontend.vllm_metrics import RequestMeter, VllmMetrics
from tandem_serve.ipc.channels import AsyncReceiver, Sender
from tandem_serve.ipc.token_channel import owner
from tandem_serve.ipc.tracing import TRACER, ProfileWindow, set_role
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.control_messages import ControlDone, EngineControl, Ready
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable, GuidedWanted
from tandem_serve.proto.monitor_messages import (
    EngineStats,
    Heartbeat,
    PostprocStats,
    ProfileControl,
    ProfileData,
)
from tandem_serve.proto.plan_messages import WorkerReady
from tandem_serve.proto.pooling_messages import PoolOutput
from tandem_serve.proto.request_messages import (
    AbortRequest,
    AddRequest,
    ForgetRequest,
    RegisterRequest,
    RequestFailed,
    RequestRejected,
)
from tandem_serve.proto.request_params import (
    FinishReason,
    ImageInput,
    OutputOptions,
    SamplingParams,
)
from tandem_serve.proto.token_messages import OutputBatch, OutputDelta

log = logging.getLogger("tandem.frontend")


class EngineError(Exception):
    """A request the engine could not serve; `code` names the gRPC status to answer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "RESOURCE_EXHAUSTED" | "UNAVAILABLE" | "INVALID_ARGUMENT" | ...


class ProfileBusy(Exception):
    """A second profile was asked for while one is recording."""


@dataclass
class OpenStream:
    """One request's output while its caller reads it (`EngineClient.generate`)."""

    buf: StreamBuffer
    started: float
    name: str = ""  # the client's correlation id, for the log
    orphaned: bool = False  # the set of roles it was sent to is gone: nothing to abort


@dataclass
class _Recording:
    """The ProfileData of one `tandem profile`, one per process role."""

    expected: int
    profiles: dict[str, ProfileData] = field(default_factory=dict)
    worker_sent: asyncio.Event = field(default_factory=asyncio.Event)
    complete: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, data: ProfileData) -> None:
        self.profiles.setdefault(data.role, data)
        if data.role == "gpu-worker":
            self.worker_sent.set()
        if len(self.profiles) >= self.expected:
            self.complete.set()


class EngineClient:
    def __init__(self, cfg: ServerConfig, model_name: str = "") -> None:
        """`model_name`: the vLLM-named metrics' model_name label (the name /v1/models lists
        first; the --model path when not given)."""
        addr = cfg.addresses
        self.cfg = cfg
        self.vllm_metrics = VllmMetrics(model_name or cfg.model,
                                        cfg.max_loras if cfg.adapter_cache else 0,
                                        cfg.enable_prefix_caching)
        self._inbox: AsyncReceiver = AsyncReceiver(addr.frontend_inbox, bind=True)
        self._to_scheduler: Sender = Sender(addr.scheduler_inbox)
        # --runner pooling has no postproc workers.
        self._to_postproc: list[Sender] = [Sender(a) for a in addr.postproc_inboxes] \
            if cfg.runner != "pooling" else []
        self._to_worker: Sender = Sender(addr.worker_inbox)  # profiling control only
        # Compiled constraints go to the scheduler on their own, once per id.
        self._constraints = ConstraintSender(self._to_scheduler.put)
        set_role("frontend")
        self._recording: _Recording | None = None  # the `tandem profile` in progress
        self._streams: dict[int, OpenStream] = {}
        # Ids unique across restarts of the frontend, so stale messages never alias.
        self._ids = itertools.count((os.getpid() << 32) | (int(time.time()) & 0xFFFF) << 16)
        self._images: dict[int, list[ImageInput]] = {}  # by request id, until sent
        self.limits: WorkerReady | None = None
        self._ready_postproc: set[int] = set()
        self.ready = asyncio.Event()
        self.dead: str | None = None  # set when a process of the engine died
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None  # roles on their own
        # Request traces: the scheduler's per-request queue times (ids, seconds).
        self.on_queue_times: Callable[[list[int], list[float]], None] | None = None
        self.stats: EngineStats | None = None  # the scheduler's latest report (admin service)
        self.liveness = Liveness(cfg.liveness_timeout, time.monotonic())  # GET /live
        self.on_control: Callable[[ControlDone], None] | None = None  # engine_control.py
        self._reader: asyncio.Task | None = None
        # --runner pooling: prefill-only requests whose outputs are vectors.
        self.pooler = Pooler(self._to_scheduler.put, self.new_request_id, self.vllm_metrics)

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self.pooler.num_in_flight

    @property
    def drained_at(self) -> float:
        """When the inbox was last read to its end (time.monotonic()); see `ipc.peers`."""
        return self._inbox.drained_at

    async def _read_loop(self) -> None:
        while True:
            msg = await self._inbox.get()
            if isinstance(msg, OutputBatch):
                with TRACER.span("route"):
                    for d in msg.deltas:
                        self._route(d.request_id, d)
            elif isinstance(msg, PoolOutput):
                self.pooler.on_output(msg)
            elif isinstance(msg, RequestRejected) and self.pooler.on_rejected(msg):
                pass
            elif isinstance(msg, (RequestRejected, RequestFailed)):
                self._route(msg.request_id, msg)
            elif isinstance(msg, GuidedWanted):
                self._constraints.on_wanted(msg)
            elif isinstance(msg, WorkerReady):
                self.limits = msg
                self.vllm_metrics.on_ready(msg)
                self._check_ready()
            elif isinstance(msg, Ready):
                self._ready_postproc.add(msg.index)
                self._check_ready()
            elif isinstance(msg, ProfileData):
                if self._recording is not None:
                    self._recording.add(msg)
            elif isinstance(msg, Heartbeat):
                if self.on_heartbeat is not None:
                    self.on_heartbeat(msg)
            elif isinstance(msg, EngineStats):
                self.stats = msg
                self.liveness.on_stats(msg, time.monotonic())
                if self.on_queue_times is not None:
                    self.on_queue_times(msg.queue_time_ids, msg.queue_times_s)
                metrics.on_stats(msg)
                self.vllm_metrics.on_stats(msg)
            elif isinstance(msg, PostprocStats):
                metrics.on_postproc_stats(msg)
            elif isinstance(msg, ControlDone):
                if self.on_control is not None:
                    self.on_control(msg)
            else:
                log.error("unexpected message %s", type(msg).__name__)

    def _check_ready(self) -> None:
        if self.limits and len(self._ready_postproc) == len(self._to_postproc):
            self.ready.set()

    def _route(self, rid: int, item: object) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        # Bounded memory for clients that read slower than tokens come (frontend/stream_buffer.py).
        if not stream.buf.put(item):
            self._overflowed(rid, stream)

    def _overflowed(self, rid: int, stream: OpenStream) -> None:
        """The client stopped reading: cancel the request now, so its KV blocks come back,
        and end the RPC with RESOURCE_EXHAUSTED whenever the client reads again."""
        held, limit = stream.buf.buffered, stream.buf.limit
        log.warning("[%s] request %d cancelled: its client is not reading (%d bytes of output "
                    "buffered, --max-stream-buffer-bytes %d)", stream.name or "-", rid, held,
                    limit)
        metrics.SLOW_CLIENTS.inc()
        self.abort(rid)
        stream.buf.queue.put_nowait(EngineError(
            "RESOURCE_EXHAUSTED", f"client is not reading: {held} bytes of output buffered "
            f"for this stream, over the server's limit of {limit} "
            f"(--max-stream-buffer-bytes); the request was cancelled"))

    def fail_all(self, message: str) -> None:
        """A process died: every open stream ends with UNAVAILABLE."""
        self.dead = message
        for stream in self._streams.values():
            stream.buf.queue.put_nowait(EngineError("UNAVAILABLE", message))
        self.pooler.fail_all(EngineError("UNAVAILABLE", message))

    def reset(self, message: str) -> None:
        """The roles behind us were replaced (`ipc.peers`): every open stream ends with
        UNAVAILABLE, and readiness waits for the new set's handshake."""
        for stream in self._streams.values():
            stream.orphaned = True
            stream.buf.queue.put_nowait(EngineError("UNAVAILABLE", message))
        self._constraints.reset()
        self.limits = None
        self._ready_postproc.clear()
        self.ready.clear()
        self.stats = None
        self.liveness.reset(time.monotonic())

    def new_request_id(self) -> int:
        return next(self._ids)

    def attach_images(self, request_id: int, images: list[ImageInput]) -> None:
        """Images that request `request_id` (an id from `new_request_id`) carries to the
        scheduler and the gpu worker; `generate` takes them when it sends the request."""
        self._images[request_id] = images

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       options: OutputOptions, deadline: float | None = None,
                       name: str = "", request_id: int | None = None,
                       arrived: float | None = None,
                       guided: GuidedTable | GuidedGrammar | None = None,
                       adapter_id: str = "", metered: bool = True
                       ) -> AsyncIterator[OutputDelta]:
        """Deltas of one request until its final one; aborts it when the caller goes away.

        `deadline` (time.monotonic()) ends the request with TIME_LIMIT when it passes.
        `name` (the client's correlation id) tags our log lines about the request.
        `request_id` (from `new_request_id`) when the caller tagged spans with it already;
        `arrived` (time.monotonic()) when the RPC arrived, so latencies count tokenizing too.
        `guided`: the compiled constraint `sampling.guided_id` names (sent on its own before
        the request unless the scheduler has it: `frontend/constraints.py`).
        `adapter_id`: a LoRA adapter the caller validated ("": the base model).
        `metered`: False leaves the request out of the vLLM-named metrics, which count clients'
        requests (the frontend's warm-up is not one).
        """
        images = self._images.pop(request_id, []) if request_id is not None else []
        if self.dead:
            raise EngineError("UNAVAILABLE", self.dead)
        if self.cfg.runner == "pooling":
            raise EngineError("INVALID_ARGUMENT", "this server runs --runner pooling "
                              "(embeddings, rerank, score): it generates no text")
        rid = self.new_request_id() if request_id is None else request_id
        stream = OpenStream(StreamBuffer(self.cfg.max_stream_buffer_bytes),
                         time.monotonic() if arrived is None else arrived, name)
        self._streams[rid] = stream
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        ended_by_engine = False  # else (cancel, time limit, death) we must abort it
        meter = self.vllm_metrics.request(len(prompt_ids), stream.started) if metered else None
        try:
            if guided is not None:  # before the request, on the same channel: there first
                self._constraints.open(guided)
            self._to_postproc[owner(rid, len(self._to_postproc))].put(
                RegisterRequest(rid, prompt, options, sampling.max_new_tokens))
            self._to_scheduler.put(AddRequest(rid, prompt, sampling, stream.started,
                                              adapter_id=adapter_id,
                                              images=images))
            last_at: float | None = None
            while True:
                item = await self._next(stream, deadline)
                if item is None:  # time limit
                    yield _metered(meter, OutputDelta(rid, "", -1,
                                                      finish_reason=FinishReason.TIME_LIMIT))
                    return
                if isinstance(item, EngineError):
                    raise item
                if isinstance(item, RequestRejected):  # the postproc side still forgets it
                    metrics.REJECTED.inc()
                    raise EngineError("RESOURCE_EXHAUSTED", item.message)
                if isinstance(item, RequestFailed) and item.code:  # e.g. its adapter's load
                    raise EngineError(item.code, item.message)
                if isinstance(item, RequestFailed):  # e.g. outgrew the KV cache: TOKEN_LIMIT
                    log.warning("[%s] request %d ended by the scheduler: %s", name or "-", rid,
                                item.message)
                    yield _metered(meter, OutputDelta(rid, "", -1, finish_reason=item.reason))
                    return
                assert isinstance(item, OutputDelta), type(item)
                ended_by_engine = item.finish_reason != FinishReason.NOT_FINISHED
                last_at = _observe(stream.started, last_at, _metered(meter, item))
                yield item
                if ended_by_engine:
                    return
        except (GeneratorExit, asyncio.CancelledError):  # the caller went away
            if meter is not None:
                meter.on_abort(time.monotonic())
            raise
        finally:
            del self._streams[rid]
            # An overflow aborted it already; an orphan's roles are gone.
            if not (ended_by_engine or stream.buf.overflowed or stream.orphaned):
                self.abort(rid)
            if guided is not None:  # after the abort: an answer to GuidedWanted follows it
                self._constraints.close(guided)

    async def _next(self, stream: OpenStream, deadline: float | None) -> object | None:
        queue = stream.buf.queue
        if deadline is None:
            item = await queue.get()
        else:
            left = deadline - time.monotonic()
            if left <= 0 and queue.empty():
                return None
            try:
                item = await asyncio.wait_for(queue.get(), timeout=max(left, 0.0))
            except asyncio.TimeoutError:
                return None
        stream.buf.took(item)
        return item

    def control(self, msg: EngineControl) -> None:
        """A rollout control, to the scheduler (`frontend/engine_control.py`)."""
        self._to_scheduler.put(msg)

    def abort(self, rid: int) -> None:
        if self.dead:
            return
        self._to_scheduler.put(AbortRequest(rid))
        self._to_postproc[owner(rid, len(self._to_postproc))].put(ForgetRequest(rid))

    async def profile(self, duration: float, plans: int = 0,
                      torch_trace: str = "") -> list[dict]:
        """Spans from every process (the frontend's own included), one dict per process.

        The window ends after `duration` seconds or, with `plans`, once the gpu worker has
        finished that many plans: it stops by itself and sends its data unasked, and its
        arrival stops everyone else.  `torch_trace` (an absolute path) has the gpu worker run
        torch.profiler over the same window and write its trace there.
        """
        if self._recording is not None:
            raise ProfileBusy("a profile is already recording")
        rec = self._recording = _Recording(expected=2 + len(self._to_postproc))
        others = [self._to_scheduler, *self._to_postproc]
        try:
            self._to_worker.put(ProfileControl(True, plans, torch_trace))
            for s in others:
                s.put(ProfileControl(True))
            TRACER.start(ProfileWindow(plans, time.monotonic_ns() + int(duration * 1e9)))
            try:  # without a plan count the worker only answers the stop below
                await asyncio.wait_for(rec.worker_sent.wait(), timeout=duration)
            except asyncio.TimeoutError:
                pass
            own = TRACER.stop()
            for s in others:
                s.put(ProfileControl(False))
            if not rec.worker_sent.is_set():
                self._to_worker.put(ProfileControl(False))
            # The gpu worker answers between plans, so the wait can be a plan long.
            await asyncio.wait_for(rec.complete.wait(), timeout=max(30.0, duration))
        finally:
            if TRACER.enabled:  # cancelled (the client went away): leave nobody recording
                TRACER.stop()
                for s in [*others, self._to_worker]:
                    s.put(ProfileControl(False))
            self._recording = None
        return [own] + [dataclasses.asdict(p) for p in rec.profiles.values()]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._inbox.close()
        self._to_scheduler.close()
        self._to_worker.close()
        for s in self._to_postproc:
            s.close()


def _metered(meter: RequestMeter | None, d: OutputDelta) -> OutputDelta:
    if meter is not None:
        meter.on_delta(d, time.monotonic())
    return d


def _observe(started: float, last_at: float | None, d: OutputDelta) -> float:
    """TTFT / inter-token / end-to-end latencies of one request into the histograms."""
    now = time.monotonic()
    if last_at is None:
        metrics.TTFT.observe(now - started)
    else:
        metrics.ITL.observe(now - last_at)
    if d.finish_reason != FinishReason.NOT_FINISHED:
        metrics.E2E.observe(now - started)
        metrics.REQUESTS.labels(d.finish_reason.name).inc()
    return now
