"""The gpu worker process.

Receive a `StepPlan` → apply its deltas → prefill → K decode steps, each step's tokens
published to the postproc workers while the next computes → `StepDone` to the scheduler.
In async mode it says `PlanEnding` about `--plan-lead-ms` before a plan ends, so the next
plan is queued by then: it never waits for postprocessing or for the scheduler.

Under tensor parallelism this is rank 0, which also forwards every plan, profile control
and shutdown to the other ranks before it runs them (`gpu_worker.parallel.Leader`); they
run `gpu_worker.follower`.
"""
from __future__ import annotations

import logging
import os
import time
from functools import partial

from tandem_serve.gpu_worker import parallel
from tandem_serve.gpu_worker.build import build_runner
from tandem_serve.gpu_worker.follower import run_follower
from tandem_serve.gpu_worker.publisher import TokenPublisher
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.sleep import SleepMode
from tandem_serve.gpu_worker.steps import attention_tokens
from tandem_serve.gpu_worker.torch_trace import TorchTrace
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.role_loop import Announce, RoleLoop
from tandem_serve.ipc.token_channel import TokenWriter
from tandem_serve.ipc.tracing import TRACER, on_plan_done
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.control_messages import EngineControl
from tandem_serve.proto.monitor_messages import ProfileControl
from tandem_serve.proto.plan_messages import PlanEnding, StepPlan, WorkerReady

log = logging.getLogger("tandem.gpu_worker")


def run_gpu_worker(cfg: ServerConfig, rank: int = 0) -> None:
    if cfg.runner == "pooling":  # embeddings, rerank, score: gpu_worker/pooling/
        from tandem_serve.gpu_worker.pooling.main import run_pooling_worker

        run_pooling_worker(cfg, rank)
        return
    if rank > 0:  # a tensor-parallel rank: rank 0 hands it the plans
        run_follower(cfg, rank)
        return
    addr = cfg.addresses
    to_frontend: Sender = Sender(addr.frontend_inbox)  # profile data, controls' answers
    with RoleLoop(cfg, "gpu-worker", title=cfg.worker_role(0), log=log, reply=to_frontend,
                  inbox=Receiver(addr.worker_inbox, bind=True)) as role:
        to_scheduler: Sender = role.own(Sender(addr.scheduler_inbox))
        tokens = role.own(TokenWriter(addr))
        ranks, tp = (role.enter(parallel.lead(cfg)) if cfg.tensor_parallel_size > 1
                     else (None, None))
        runner = build_runner(cfg, tp)
        if ranks is not None:
            ranks.wait_followers()
        tokens.wait_ready()
        worker = GpuWorker(cfg, role, runner, TokenPublisher(tokens.put, runner.device),
                           to_scheduler, to_frontend, ranks)
        ready = WorkerReady(runner.num_blocks, runner.block_size, runner.max_model_len,
                            runner.vocab_size, long_rope_from=runner.long_rope_from,
                            device_type=runner.device.type,
                            attention_tokens=attention_tokens(runner.model.config),
                            num_host_blocks=runner.num_host_blocks,
                            recurrent_state=runner.model.config.is_hybrid,
                            state_checkpoint_blocks=runner.state_checkpoint_blocks)
        # On our own, WorkerReady goes with every heartbeat of the frontend once we joined
        # its set: the scheduler of our set may not be up yet, and one of the set we replace
        # may still hold its address.  The scheduler keeps the first.
        role.run({StepPlan: worker.run_plan, ProfileControl: worker.profile,
                  EngineControl: worker.control},
                 ready=Announce(to_scheduler, ready, f"pid {os.getpid()}", repeat=True),
                 idle=ranks.idle if ranks is not None else None, on_shutdown=worker.forward)


class GpuWorker:
    """Rank 0's handlers, and what it keeps between plans."""

    def __init__(self, cfg: ServerConfig, role: RoleLoop, runner: ModelRunner,
                 publisher: TokenPublisher, to_scheduler: Sender, to_frontend: Sender,
                 ranks: parallel.Leader | None) -> None:
        self.cfg, self.role, self.runner, self.publisher = cfg, role, runner, publisher
        self.to_scheduler, self.to_frontend, self.ranks = to_scheduler, to_frontend, ranks
        self.torch_trace = TorchTrace(runner.device)  # `tandem profile --torch-profiler FILE`
        self.paced = cfg.pace_plans and cfg.async_postproc  # tell the scheduler when it ends
        self.idle_since = time.monotonic_ns()
        self.sleep = SleepMode(runner)  # the rollout controls (gpu_worker/sleep.py)

    def forward(self, msg: object) -> None:
        """To the other ranks, before rank 0 runs it: the ranks run each plan together."""
        if self.ranks is not None:
            self.ranks.forward(msg)

    def run_plan(self, plan: StepPlan) -> None:
        self.forward(plan)
        self.role.maybe_fault(plan.plan_id)
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
        if recording and not TRACER.enabled:
            self.forward(ProfileControl(start=False))  # their torch traces end too
        self.idle_since = time.monotonic_ns()

    def profile(self, msg: ProfileControl) -> None:
        self.forward(msg)
        self.role.profile(msg, self.torch_trace)

    def control(self, msg: EngineControl) -> None:
        """Sleep, wake-up or a weight reload, on every rank; rank 0 answers the frontend."""
        self.forward(msg)
        self.to_frontend.put(self.sleep.handle(msg))
