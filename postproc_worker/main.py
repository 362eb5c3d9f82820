"""A postproc worker process.

Receive a token batch (ring or inbox) → for each row it owns: detokenize, check stops,
attach token detail → one `OutputBatch` per step to the frontend; a stop string sends
`StopHit` to the scheduler at once; after a plan's last batch, `PlanProcessed`.
Requests arrive as `RegisterRequest` from the frontend before their first token can.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.role_loop import Announce, RoleLoop
from tandem_serve.ipc.shm_ring import RingClosed
from tandem_serve.ipc.token_channel import TokenReader, open_reader, owner
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.postproc_worker.lag import LagMeter
from tandem_serve.postproc_worker.postprocessor import Postprocessor
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.control_messages import Ready, Shutdown
from tandem_serve.proto.request_messages import ForgetRequest, RegisterRequest
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import (
    OutputBatch,
    OutputDelta,
    PlanProcessed,
    PromptDetail,
    StopHit,
    TokenBatch,
)
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.postproc")


def run_postproc(cfg: ServerConfig, index: int) -> None:
    addr = cfg.addresses
    workers = len(addr.postproc_inboxes)
    to_frontend: Sender = Sender(addr.frontend_inbox)
    with RoleLoop(cfg, "postproc", index, log=log, reply=to_frontend,
                  inbox=Receiver(addr.postproc_inboxes[index], bind=True)) as role:
        to_scheduler: Sender = role.own(Sender(addr.scheduler_inbox))
        tokens = role.own(TokensAfterInbox(role.inbox, open_reader(addr, index)))
        worker = PostprocWorker(role, Postprocessor(Tokenizer.from_dir(cfg.model), index),
                                tokens, to_frontend, to_scheduler, workers)
        role.run({TokenBatch: worker.on_tokens, PromptDetail: worker.on_prompt_detail,
                  RegisterRequest: worker.register, ForgetRequest: worker.forget},
                 source=tokens, work=worker.work,
                 ready=Announce(to_frontend, Ready("postproc", index),
                                f"worker {index} of {workers}"))


class PostprocWorker:
    """The worker's handlers and its work after each receive (expiry, the lag gauge)."""

    def __init__(self, role: RoleLoop, proc: Postprocessor, tokens: TokensAfterInbox,
                 to_frontend: Sender, to_scheduler: Sender, workers: int) -> None:
        self.role, self.proc, self.tokens, self.workers = role, proc, tokens, workers
        self.to_frontend, self.to_scheduler = to_frontend, to_scheduler
        self.index = proc.index
        self.busy: dict[int, float] = {}  # plan id -> seconds spent on its batches so far
        self.lag = LagMeter(proc.index)
        self.last_expire = time.monotonic()

    def on_tokens(self, msg: TokenBatch) -> None:
        self.role.maybe_fault(msg.plan_id)
        t0 = time.perf_counter()
        with TRACER.span("detokenize", msg.plan_id, msg.step):
            deltas = self.proc.on_batch(msg)
        with TRACER.span("send", msg.plan_id, msg.step):
            self.send(deltas)
        self.busy[msg.plan_id] = self.busy.get(msg.plan_id, 0.0) + time.perf_counter() - t0
        if msg.last:
            self.to_scheduler.put(PlanProcessed(msg.plan_id, self.index,
                                                self.busy.pop(msg.plan_id)))
        self.lag.observe(self.tokens.backlog())

    def on_prompt_detail(self, msg: PromptDetail) -> None:
        # Over the ring every reader sees every message; only the owner keeps it.
        if owner(msg.request_id, self.workers) == self.index:
            self.send(self.proc.on_prompt_detail(msg))

    def register(self, msg: RegisterRequest) -> None:
        self.send(self.proc.register(msg))

    def forget(self, msg: ForgetRequest) -> None:
        self.proc.forget(msg.request_id)

    def send(self, deltas: list[OutputDelta]) -> None:
        for d in deltas:  # stop hits first: the scheduler should drop these soonest
            if d.finish_reason == FinishReason.STOP_SEQUENCE:
                self.to_scheduler.put(StopHit(d.request_id, d.num_generated))
        if deltas:
            self.to_frontend.put(OutputBatch(deltas))

    def work(self) -> None:
        now = time.monotonic()
        if now - self.last_expire > 1.0:
            self.proc.expire(now)
            self.last_expire = now
        stats = self.lag.report(now)
        if stats is not None:
            self.to_frontend.put(stats)


class TokensAfterInbox:
    """The worker's source: everything waiting in its inbox first (a registration must be
    known before the tokens it precedes), then the next token batch from the ring or, without
    the ring, whatever comes to the inbox next.  A ring the gpu worker closed cleanly reads
    as a Shutdown: so do we exit."""

    RING_WAIT = 0.05  # seconds on the ring before the inbox is read again
    INBOX_WAIT = 0.5  # without the ring: within ipc.peers.HEARTBEAT_INTERVAL

    def __init__(self, inbox: Receiver[Any], ring: TokenReader | None) -> None:
        self.inbox, self.ring = inbox, ring
        self.queued = 0  # without the ring: token batches drained, not handled yet

    def receive(self) -> Iterator[Any]:
        msgs = self.inbox.drain()
        self.queued = sum(isinstance(m, TokenBatch) for m in msgs)
        for msg in msgs:
            if isinstance(msg, TokenBatch):
                self.queued -= 1
            yield msg
        msg = self.inbox.get(timeout=self.INBOX_WAIT) if self.ring is None else self._ring()
        if msg is not None:
            yield msg

    def _ring(self) -> TokenBatch | PromptDetail | Shutdown | None:
        assert self.ring is not None
        try:
            return self.ring.get(timeout=self.RING_WAIT)
        except RingClosed:
            return Shutdown("the gpu worker closed the token ring")

    def backlog(self) -> int:
        """Token batches the gpu worker published that this worker has not handled yet."""
        return self.ring.backlog() if self.ring is not None else self.queued

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
