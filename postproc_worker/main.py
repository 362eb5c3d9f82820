"""A postproc worker process.

Receive a token batch (ring or inbox) → for each row it owns: detokenize, check stops,
attach token detail → one `OutputBatch` per step to the frontend; a stop string sends
`StopHit` to the scheduler at once; after a plan's last batch, `PlanProcessed`.
Requests arrive as `RegisterRequest` from the frontend before their first token can.
"""
from __future__ import annotations

import logging
import time

from postproc_worker.output import RequestOutput, RowDetail, row_detail
from proto.config import ServerConfig
from proto.messages import (FinishReason, ForgetRequest, OutputBatch, OutputDelta, PlanProcessed,
                            Ready, RegisterRequest, Shutdown, StopHit, TokenBatch)
from rpc.channels import Receiver, Sender
from rpc.shm_ring import RingClosed
from rpc.token_channel import open_reader
from rpc.tokenizer import Tokenizer

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
        self.pending: dict[int, tuple[float, list[tuple[int, FinishReason, RowDetail]]]] = {}

    def register(self, msg: RegisterRequest) -> list[OutputDelta]:
        req = RequestOutput(msg, self.tok)
        self.requests[msg.request_id] = req
        _, early = self.pending.pop(msg.request_id, (0.0, []))
        return [self._add(req, *row) for row in early if not req.done]

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
            deltas.append(self._add(req, *row))
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


def run_postproc(cfg: ServerConfig, index: int) -> None:
    addr = cfg.addresses
    inbox: Receiver = Receiver(addr.postproc_inboxes[index], bind=True)
    to_frontend: Sender = Sender(addr.frontend_inbox)
    to_scheduler: Sender = Sender(addr.scheduler_inbox)
    ring = open_reader(addr, index)
    proc = Postprocessor(Tokenizer.from_dir(cfg.model), index)
    last_expire = time.monotonic()

    def send(deltas: list[OutputDelta]) -> None:
        for d in deltas:  # stop hits first: the scheduler should drop these soonest
            if d.finish_reason == FinishReason.STOP_SEQUENCE:
                to_scheduler.put(StopHit(d.request_id, d.num_generated))
        if deltas:
            to_frontend.put(OutputBatch(deltas))

    def handle(msg: object) -> None:
        if isinstance(msg, TokenBatch):
            send(proc.on_batch(msg))
            if msg.last:
                to_scheduler.put(PlanProcessed(msg.plan_id, index))
        elif isinstance(msg, RegisterRequest):
            send(proc.register(msg))
        elif isinstance(msg, ForgetRequest):
            proc.forget(msg.request_id)
        else:
            log.error("unexpected message %s", type(msg).__name__)

    to_frontend.put(Ready("postproc", index))
    log.info("ready (worker %d of %d)", index, len(addr.postproc_inboxes))
    try:
        while True:
            # Registrations first: they must be known before the tokens they precede.
            for msg in inbox.drain():
                if isinstance(msg, Shutdown):
                    return
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
                if msg is not None:
                    handle(msg)
            now = time.monotonic()
            if now - last_expire > 1.0:
                proc.expire(now)
                last_expire = now
    finally:
        if ring is not None:
            ring.close()
        inbox.close()
        to_frontend.close()
        to_scheduler.close()
