"""A tensor-parallel gpu worker rank other than 0.

It holds its shard of the model and of the KV cache and runs every plan rank 0 forwards,
with the same `ModelRunner.execute` and a publisher that publishes nothing: its collectives
meet rank 0's, and since every rank applies the same deltas and samples the same gathered
logits with the same counter-based sampler, its per-request state stays identical to rank
0's without any token crossing between them.  Rank 0 alone talks to the scheduler and the
postproc workers.

Supervision: on one host the launcher watches every rank as a child.  A rank on another
host (`tandem run-role gpu-worker --node-rank R`) has no launcher above it: it watches rank
0 by the heartbeats rank 0 sends on the plan channel when idle, and exits non-zero when they
stop; a rank 0 that dies in a collective makes the collective fail at once.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from tandem_serve.gpu_worker import parallel
from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors
from tandem_serve.gpu_worker.build import build_runner
from tandem_serve.gpu_worker.publisher import MakeDetails, TokenPublisher
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.sleep import SleepMode
from tandem_serve.gpu_worker.torch_trace import TorchTrace
from tandem_serve.ipc.channels import Receiver
from tandem_serve.ipc.fanout import subscribe
from tandem_serve.ipc.peers import HEARTBEAT_INTERVAL, PEER_TIMEOUT, START_GRACE
from tandem_serve.ipc.role_loop import RoleLoop
from tandem_serve.proto.config import ServerConfig, plans_address
from tandem_serve.proto.control_messages import EngineControl
from tandem_serve.proto.monitor_messages import ProfileControl
from tandem_serve.proto.plan_messages import StepPlan
from tandem_serve.proto.token_messages import PromptDetail

log = logging.getLogger("tandem.gpu_worker")


class NullPublisher(TokenPublisher):
    """The publisher of a rank > 0: rank 0 publishes the (identical) tokens."""

    def __init__(self) -> None:  # no thread, no sink
        pass

    def __call__(self, plan: StepPlan, batch: DecodeBatch, st: StepTensors,
                 last: bool) -> None:
        pass

    def send_detail(self, msg: PromptDetail) -> None:
        pass

    def send_scores(self, scores: list[torch.Tensor], make: MakeDetails) -> None:
        pass

    def end_of_plan(self, plan: StepPlan) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def rank_trace_path(path: str, rank: int) -> str:
    """`--torch-profiler trace.json` -> `trace.rank1.json` for rank 1 (rank 0 keeps `path`)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


class _Silence:
    """Rank 0's silence, as a rank on another host sees it between plans."""

    def __init__(self, watching: bool) -> None:
        self.watching = watching
        self.last: float | None = None  # None until rank 0's first message
        self.started = time.monotonic()

    def heard(self) -> None:
        self.last = time.monotonic()

    def check(self) -> None:
        if not self.watching:
            return
        now = time.monotonic()
        if self.last is None and now - self.started > START_GRACE:
            raise parallel.RankLost(f"gpu worker rank 0 sent nothing in {START_GRACE:.0f} s")
        if self.last is not None and now - self.last > PEER_TIMEOUT:
            raise parallel.RankLost(f"gpu worker rank 0 stopped sending heartbeats "
                           f"({now - self.last:.1f} s ago)")


class FromRankZero:
    """A rank's source: the plan channel, and rank 0's silence on it between plans."""

    def __init__(self, plans: Receiver[Any], silence: _Silence) -> None:
        self.plans, self.silence = plans, silence

    def receive(self) -> list[Any]:
        msg = self.plans.get(timeout=HEARTBEAT_INTERVAL)
        if msg is None:
            self.silence.check()
            return []
        self.silence.heard()  # a plan, a heartbeat, anything
        return [msg]


def run_follower(cfg: ServerConfig, rank: int) -> None:
    # Subscribed before the (slow) model load, so rank 0 never waits on us for that.
    with RoleLoop(cfg, "gpu-worker", rank, title=cfg.worker_role(rank), in_set=False, log=log,
                  inbox=subscribe(plans_address(cfg))) as role:
        tp = role.own(parallel.start(cfg, rank))
        runner = build_runner(cfg, tp)
        log.info("ready (pid %d): rank %d of %d", os.getpid(), rank, cfg.tensor_parallel_size)
        # On one host the launcher supervises every rank; across hosts we watch rank 0.
        silence = _Silence(watching=cfg.node_rank > 0)
        follower = Follower(role, runner, rank, silence)
        role.run({StepPlan: follower.run_plan, ProfileControl: follower.profile,
                  EngineControl: follower.control},
                 source=FromRankZero(role.inbox, silence))


class Follower:
    """A rank's handlers: rank 0's plans, and its profile controls."""

    def __init__(self, role: RoleLoop, runner: ModelRunner, rank: int,
                 silence: _Silence) -> None:
        self.role, self.runner, self.rank, self.silence = role, runner, rank, silence
        self.publisher = NullPublisher()
        self.trace = TorchTrace(runner.device)
        self.sleep = SleepMode(runner)

    def control(self, msg: EngineControl) -> None:
        """Rank 0's sleep, wake-up or weight reload, on this rank's shard (rank 0 answers;
        a failure here has failed there too: the same folder, the same checks)."""
        self.sleep.handle(msg)
        self.silence.heard()

    def run_plan(self, plan: StepPlan) -> None:
        self.role.maybe_fault(plan.plan_id)
        self.runner.execute(plan, self.publisher)
        self.silence.heard()  # a long plan is no silence of rank 0's

    def profile(self, msg: ProfileControl) -> None:
        """Ranks > 0 record no spans (rank 0's stand for the group) but run torch.profiler
        over the same window into their own file when one is asked for."""
        if msg.start and msg.torch_trace:
            self.trace.start(ProfileControl(True, msg.plans,
                                            rank_trace_path(msg.torch_trace, self.rank)))
        elif not msg.start:
            self.trace.stop()
