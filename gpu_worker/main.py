"""The gpu worker process.

Receive a `StepPlan` → apply its deltas → prefill → K decode steps, each step's tokens
published to the postproc workers while the next computes → `StepDone` to the scheduler.
In async mode it says `PlanEnding` about `--plan-lead-ms` before a plan ends, so the next
plan is queued by then: it never waits for postprocessing or for the scheduler.

Under tensor parallelism this is rank 0, which also forwards every plan, profile control
and shutdown to the other ranks (`gpu_worker.parallel.Leader`); they run
`gpu_worker.follower`.
"""
from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import TYPE_CHECKING

from tandem_serve.gpu_worker.build import build_runner
from tandem_serve.gpu_worker.publisher import TokenPublisher
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.torch_trace import TorchTrace
from tandem_serve.ipc import faults
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.peers import HEARTBEAT_INTERVAL, RoleWatch, role_watch
from tandem_serve.ipc.token_channel import TokenWriter
from tandem_serve.ipc.tracing import TRACER, on_plan_done, on_profile_control, set_role
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.messages import (
    Heartbeat,
    PlanEnding,
    ProfileControl,
    Shutdown,
    StepPlan,
    WorkerReady,
)

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.parallel import Leader, TensorParallel

log = logging.getLogger("tandem.gpu_worker")


def run_gpu_worker(cfg: ServerConfig, rank: int = 0) -> None:
    if rank > 0:  # a tensor-parallel rank: rank 0 hands it the plans
        from tandem_serve.gpu_worker.follower import run_follower

        run_follower(cfg, rank)
        return
    addr = cfg.addresses
    inbox: Receiver = Receiver(addr.worker_inbox, bind=True)
    to_scheduler: Sender = Sender(addr.scheduler_inbox)
    tokens = TokenWriter(addr)
    tp: TensorParallel | None = None
    ranks: Leader | None = None
    try:
        if cfg.tensor_parallel_size > 1:
            from tandem_serve.gpu_worker import parallel

            ranks = parallel.Leader(cfg)  # bound first: the others subscribe as they start
            tp = parallel.start(cfg, 0)
        runner = build_runner(cfg, tp)
        if ranks is not None:
            ranks.wait_followers()
        tokens.wait_ready()
        publisher = TokenPublisher(tokens.put, runner.device)
        ready = WorkerReady(runner.num_blocks, runner.block_size, runner.max_model_len,
                            runner.vocab_size)
        peers = role_watch(cfg, "gpu-worker")
        if peers is None:  # under the launcher; on our own, once in the frontend's set
            to_scheduler.put(ready)
            log.info("ready (pid %d)", os.getpid())
        to_frontend: Sender = Sender(addr.frontend_inbox)  # profile data only
        set_role("gpu-worker")
        loop = _Loop(cfg, runner, publisher, to_scheduler, to_frontend, ranks, ready, peers)
        while True:
            if peers is not None:
                peers.check(inbox.drained_at)  # on its own: lose the frontend, exit non-zero
            msg = inbox.get(timeout=HEARTBEAT_INTERVAL if peers else 1.0)
            if msg is None:
                if ranks is not None:
                    ranks.idle()
                continue
            if ranks is not None and isinstance(msg, (Shutdown, StepPlan, ProfileControl)):
                ranks.forward(msg)  # before running it: the ranks run each plan together
            if isinstance(msg, Shutdown):
                log.info("shutting down: %s", msg.reason)
                return
            if isinstance(msg, StepPlan):
                loop.run_plan(msg)
            elif isinstance(msg, Heartbeat):
                loop.on_heartbeat(msg)
            elif isinstance(msg, ProfileControl):
                on_profile_control(msg, loop.to_frontend, loop.torch_trace)
            else:
                log.error("unexpected message %s", type(msg).__name__)
    except SystemExit:  # SIGTERM: the other ranks stop too (ranks on other hosts exit 0)
        if ranks is not None:
            ranks.forward(Shutdown("gpu worker rank 0 stopped"))
        raise
    finally:
        if ranks is not None:
            ranks.close()
        if tp is not None:
            tp.close()
        tokens.close()
        inbox.close()
        to_scheduler.close()


class _Loop:
    """What the main loop does with a plan or a heartbeat, and the state it keeps between."""

    def __init__(self, cfg: ServerConfig, runner: ModelRunner, publisher: TokenPublisher,
                 to_scheduler: Sender, to_frontend: Sender, ranks: Leader | None,
                 ready: WorkerReady, peers: RoleWatch | None) -> None:
        self.cfg, self.runner, self.publisher = cfg, runner, publisher
        self.to_scheduler, self.to_frontend, self.ranks = to_scheduler, to_frontend, ranks
        self.ready, self.peers = ready, peers
        self.torch_trace = TorchTrace(runner.device)  # `tandem profile --torch-profiler FILE`
        self.paced = cfg.pace_plans and cfg.async_postproc  # tell the scheduler when it ends
        self.idle_since = time.monotonic_ns()

    def run_plan(self, plan: StepPlan) -> None:
        faults.maybe_fire(self.cfg.worker_role(0), plan.plan_id)  # tests only; else no-op
        started = time.monotonic_ns()
        TRACER.record("idle", self.idle_since, started, plan.plan_id)
        ending = partial(self.to_scheduler.put, PlanEnding(plan.plan_id)) if self.paced \
            else None
        done = self.runner.execute(plan, self.publisher, ending, self.cfg.plan_lead_ms / 1000)
        done.idle_time = (started - self.idle_since) / 1e9
        for failure in self.runner.take_adapter_failures():  # before the StepDone
            self.to_scheduler.put(failure)
        self.to_scheduler.put(done)
        recording = TRACER.enabled
        on_plan_done(self.to_frontend, self.torch_trace)  # `tandem profile --plans N` ends here
        if self.ranks is not None and recording and not TRACER.enabled:
            self.ranks.forward(ProfileControl(start=False))  # their torch traces end too
        self.idle_since = time.monotonic_ns()

    def on_heartbeat(self, msg: Heartbeat) -> None:
        """On our own (not under the launcher): join the frontend's set, then tell its
        scheduler we are ready with every heartbeat of the frontend - when we join, the
        scheduler of our set may not be up yet, and one of the set we replace may still
        hold the address.  The scheduler keeps the first."""
        if self.peers is None:
            return
        if self.peers.seen(msg):
            log.info("ready (pid %d), in the set of epoch %x", os.getpid(), self.peers.epoch)
        if self.peers.epoch:
            self.to_scheduler.put(self.ready)
