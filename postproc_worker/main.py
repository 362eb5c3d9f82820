"""A postproc worker process.

Receive a token batch (ring or inbox) → for each row it owns: detokenize, check stops,
attach token detail → one `OutputBatch` per step to the frontend; a stop string sends
`StopHit` to the scheduler at once; after a plan's last batch, `PlanProcessed`.
Requests arrive as `RegisterRequest` from the frontend before their first token can.
"""
from __future__ import annotations

import logging
import time

from tandem_serve.ipc import faults
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.peers import role_watch
from tandem_serve.ipc.shm_ring import RingClosed
from tandem_serve.ipc.token_channel import open_reader, owner
from tandem_serve.ipc.tracing import TRACER, on_profile_control, set_role
from tandem_serve.postproc_worker.output import RequestOutput, Row, RowDetail, row_detail
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.messages import (
    FinishReason,
    ForgetRequest,
    Heartbeat,
    OutputBatch,
    OutputDelta,
    PlanProcessed,
    PostprocStats,
    ProfileControl,
    PromptDetail,
    Ready,
    RegisterRequest,
    Shutdown,
    StopHit,
    TokenBatch,
)
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.postproc")

# Tokens for a request whose registration has not arrived yet are kept this long.
PENDING_TTL = 30.0


class Postprocessor:
    """The worker's state, driven by messages; no sockets (unit tests drive it directly)."""

    def __init__(self, tok: Tokenizer, index: int) -> None:
        self.tok = tok
        self.index = index
        self.requests: dict[int, RequestOutput] = {}
        self.finished: dict[int, float] = {}  # late tokens of these are discarded
        # Tokens and prompt detail that came before their registration, in arrival order.
        self.pending: dict[int, tuple[float, list[Row | PromptDetail]]] = {}

    def register(self, msg: RegisterRequest) -> list[OutputDelta]:
        req = RequestOutput(msg, self.tok)
        self.requests[msg.request_id] = req
        _, early = self.pending.pop(msg.request_id, (0.0, []))
        deltas: list[OutputDelta] = []
        for item in early:
            if isinstance(item, PromptDetail):
                deltas += self.on_prompt_detail(item)
            elif not req.done:
                deltas += self._route(req, item)
        return deltas

    def on_prompt_detail(self, msg: PromptDetail) -> list[OutputDelta]:
        """A chunk of prompt logprobs; its last one releases the tokens that waited for it."""
        rid = msg.request_id
        if rid in self.finished:
            return []
        req = self.requests.get(rid)
        if req is None:  # registration still in flight: keep it, in order with the tokens
            self.pending.setdefault(rid, (time.monotonic(), []))[1].append(msg)
            return []
        req.add_prompt_detail(msg)
        if req.awaiting_prompt or not req.held:
            return []
        rows, req.held = req.held, []
        return [self._add(req, *row) for row in rows if not req.done]

    def _route(self, req: RequestOutput, row: Row) -> list[OutputDelta]:
        # The first delta carries the whole input detail, so it waits for the last chunk.
        if req.awaiting_prompt:
            req.held.append(row)
            return []
        return [self._add(req, *row)]

    def forget(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.finished[request_id] = time.monotonic()

    def on_batch(self, batch: TokenBatch) -> list[OutputDelta]:
        deltas: list[OutputDelta] = []
        for i, rid in enumerate(batch.request_ids.tolist()):
            tok = int(batch.token_ids[i])
            if tok < 0 or rid in self.finished:
                continue
            row = (tok, FinishReason(int(batch.finish[i])), row_detail(batch, i))
            req = self.requests.get(rid)
            if req is None:  # registration still in flight: keep the token for it
                self.pending.setdefault(rid, (time.monotonic(), []))[1].append(row)
                continue
            deltas += self._route(req, row)
        return deltas

    def _add(self, req: RequestOutput, tok: int, finish: FinishReason,
             detail: RowDetail) -> OutputDelta:
        delta = req.add(tok, finish, detail)
        if req.done:
            del self.requests[req.request_id]
            self.finished[req.request_id] = time.monotonic()
        return delta

    def expire(self, now: float) -> None:
        for rid in [r for r, (t, _) in self.pending.items() if now - t > PENDING_TTL]:
            log.warning("dropping tokens of request %d: never registered", rid)
            del self.pending[rid]
        for rid in [r for r, t in self.finished.items() if now - t > PENDING_TTL]:
            del self.finished[rid]


STATS_INTERVAL = 0.2  # seconds between PostprocStats at most, as the scheduler's EngineStats


class LagMeter:
    """How many steps this worker runs behind the gpu worker, measured after each token batch:
    the batches published and not yet processed.  A `lag_steps` counter in the profile, and the
    most over each interval to the frontend's gauge."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.peak = 0  # the most since the previous report
        self.sent = 0  # the frontend's gauge starts at 0
        self.sent_at = 0.0

    def observe(self, lag: int) -> None:
        TRACER.counter("lag_steps", lag)
        self.peak = max(self.peak, lag)

    def report(self, now: float) -> PostprocStats | None:
        """The interval's peak when one has ended and it differs from the last one sent."""
        if now - self.sent_at < STATS_INTERVAL:
            return None
        peak, self.peak, self.sent_at = self.peak, 0, now
        if peak == self.sent:
            return None
        self.sent = peak
        return PostprocStats(self.index, peak)


def run_postproc(cfg: ServerConfig, index: int) -> None:
    addr = cfg.addresses
    inbox: Receiver = Receiver(addr.postproc_inboxes[index], bind=True)
    to_frontend: Sender = Sender(addr.frontend_inbox)
    to_scheduler: Sender = Sender(addr.scheduler_inbox)
    ring = open_reader(addr, index)
    proc = Postprocessor(Tokenizer.from_dir(cfg.model), index)
    last_expire = time.monotonic()
    busy: dict[int, float] = {}  # plan id -> seconds spent on its batches so far
    lag = LagMeter(index)
    queued = 0  # without the ring: token batches drained from the inbox, not handled yet

    def backlog() -> int:
        return ring.backlog() if ring is not None else queued

    def send(deltas: list[OutputDelta]) -> None:
        for d in deltas:  # stop hits first: the scheduler should drop these soonest
            if d.finish_reason == FinishReason.STOP_SEQUENCE:
                to_scheduler.put(StopHit(d.request_id, d.num_generated))
        if deltas:
            to_frontend.put(OutputBatch(deltas))

    def handle(msg: object) -> None:
        if isinstance(msg, TokenBatch):
            faults.maybe_fire(f"postproc{index}", msg.plan_id)  # tests only; no-op otherwise
            t0 = time.perf_counter()
            with TRACER.span("detokenize", msg.plan_id, msg.step):
                deltas = proc.on_batch(msg)
            with TRACER.span("send", msg.plan_id, msg.step):
                send(deltas)
            busy[msg.plan_id] = busy.get(msg.plan_id, 0.0) + time.perf_counter() - t0
            if msg.last:
                to_scheduler.put(PlanProcessed(msg.plan_id, index, busy.pop(msg.plan_id)))
            lag.observe(backlog())
        elif isinstance(msg, PromptDetail):
            # Over the ring every reader sees every message; only the owner keeps it.
            if owner(msg.request_id, len(addr.postproc_inboxes)) == index:
                send(proc.on_prompt_detail(msg))
        elif isinstance(msg, RegisterRequest):
            send(proc.register(msg))
        elif isinstance(msg, ForgetRequest):
            proc.forget(msg.request_id)
        elif isinstance(msg, ProfileControl):
            on_profile_control(msg, to_frontend)
        else:
            log.error("unexpected message %s", type(msg).__name__)

    peers = role_watch(cfg, "postproc", index)
    if peers is None:  # under the launcher; on our own, once we joined the frontend's set
        to_frontend.put(Ready("postproc", index))
        log.info("ready (worker %d of %d)", index, len(addr.postproc_inboxes))

    def heartbeat(msg: Heartbeat) -> None:
        if peers is not None and peers.seen(msg):
            to_frontend.put(Ready("postproc", index))
            log.info("ready (worker %d of %d), in the set of epoch %x", index,
                     len(addr.postproc_inboxes), peers.epoch)

    set_role(f"postproc {index}")
    try:
        while True:
            if peers is not None:
                peers.check(inbox.drained_at)  # on its own: lose the frontend, exit non-zero
            # Registrations first: they must be known before the tokens they precede.
            msgs = inbox.drain()
            queued = sum(isinstance(m, TokenBatch) for m in msgs)
            for msg in msgs:
                if isinstance(msg, TokenBatch):
                    queued -= 1
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, Heartbeat):
                    heartbeat(msg)
                    continue
                handle(msg)
            if ring is not None:
                try:
                    batch = ring.get(timeout=0.05)
                except RingClosed:  # the gpu worker exited cleanly: so do we
                    return
                if batch is not None:
                    handle(batch)
            else:
                msg = inbox.get(timeout=0.5)
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, Heartbeat):
                    heartbeat(msg)
                elif msg is not None:
                    handle(msg)
            now = time.monotonic()
            if now - last_expire > 1.0:
                proc.expire(now)
                last_expire = now
            stats = lag.report(now)
            if stats is not None:
                to_frontend.put(stats)
    finally:
        if ring is not None:
            ring.close()
        inbox.close()
        to_frontend.close()
        to_scheduler.close()
