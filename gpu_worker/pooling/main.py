"""The gpu worker process under `--runner pooling`.

Receive a `PoolPlan` → one forward over its requests → the vectors to the frontend
(`PoolOutput`), then `PoolDone` to the scheduler, which sends the next batch.  No token ring
and no postproc worker: nothing is detokenized.

Under tensor parallelism rank 0 forwards each plan to the other ranks over the plan channel
(`gpu_worker.parallel.Leader`) before it runs it; they run the same forward on their shards
(`run_pooling_follower`) and send nothing.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch

from tandem_serve.gpu_worker import parallel
from tandem_serve.gpu_worker.build import keep_freed_memory
from tandem_serve.gpu_worker.pooling.runner import PoolingRunner, pick_device, pick_dtype
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.fanout import subscribe
from tandem_serve.ipc.peers import HEARTBEAT_INTERVAL
from tandem_serve.ipc.process import StartupError, worker_threads
from tandem_serve.ipc.role_loop import Announce, RoleLoop
from tandem_serve.ipc.tracing import TRACER, on_plan_done
from tandem_serve.pooling.folder import PoolingFolderError, PoolingSpec
from tandem_serve.proto.config import ServerConfig, plans_address
from tandem_serve.proto.plan_messages import WorkerReady
from tandem_serve.proto.pooling_messages import PoolDone, PoolOutput, PoolPlan

log = logging.getLogger("tandem.gpu_worker")


def build_pooling_runner(cfg: ServerConfig, tp: parallel.TensorParallel | None = None
                         ) -> PoolingRunner:
    """The model of a pooling folder; a folder or device we cannot serve is a StartupError."""
    try:
        spec = PoolingSpec.read(cfg.model, cfg.max_model_len)
    except PoolingFolderError as exc:
        raise StartupError(f"--model {cfg.model!r}: {exc}") from None
    device = tp.device if tp is not None else pick_device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda: no CUDA device is available; use --device cpu")
    threads = worker_threads(cfg, tp.local_rank if tp else 0)
    if threads:
        torch.set_num_threads(threads)
    try:
        runner = PoolingRunner(cfg.model, spec, device, pick_dtype(cfg.dtype, device), tp)
    except ValueError as exc:
        raise StartupError(f"--model {cfg.model!r}: {exc}") from None
    if device.type == "cpu":
        keep_freed_memory()
    log.info("pooling model %s (%s, %s pooling) on %s, %d torch threads", spec.architecture,
             spec.kind, spec.pooling, device, torch.get_num_threads())
    return runner


def run_pooling_worker(cfg: ServerConfig, rank: int = 0) -> None:
    if rank > 0:
        run_pooling_follower(cfg, rank)
        return
    addr = cfg.addresses
    to_frontend: Sender = Sender(addr.frontend_inbox)
    with RoleLoop(cfg, "gpu-worker", title=cfg.worker_role(0), log=log, reply=to_frontend,
                  inbox=Receiver(addr.worker_inbox, bind=True)) as role:
        to_scheduler: Sender = role.own(Sender(addr.scheduler_inbox))
        ranks, tp = (role.enter(parallel.lead(cfg)) if cfg.tensor_parallel_size > 1
                     else (None, None))
        runner = build_pooling_runner(cfg, tp)
        if ranks is not None:
            ranks.wait_followers()
        ready = WorkerReady(num_kv_blocks=0, block_size=1,
                            max_model_len=runner.spec.max_seq_length,
                            vocab_size=int(getattr(runner.model.config, "vocab_size", 0)),
                            device_type=runner.device.type)

        def run_plan(plan: PoolPlan) -> None:
            if ranks is not None:  # the other ranks run it with us
                ranks.forward(plan)
            role.maybe_fault(plan.plan_id)
            t0 = time.monotonic_ns()
            data = runner.run(plan.requests)
            t1 = time.monotonic_ns()
            TRACER.record("forward", t0, t1, plan.plan_id)
            ids = np.array([r.request_id for r in plan.requests], dtype=np.int64)
            to_frontend.put(PoolOutput(ids, np.ascontiguousarray(data, dtype=np.float32)))
            tokens = sum(len(r.prompt_ids) for r in plan.requests)
            to_scheduler.put(PoolDone(plan.plan_id, len(plan.requests), tokens, (t1 - t0) / 1e9))
            on_plan_done(to_frontend)  # `tandem profile --plans N` ends here

        role.run({PoolPlan: run_plan},
                 ready=Announce(to_scheduler, ready, f"pid {os.getpid()}", repeat=True),
                 idle=ranks.idle if ranks is not None else None,
                 on_shutdown=ranks.forward if ranks is not None else None)


class _Plans:
    """A follower's source: rank 0's plan channel (the launcher watches every rank)."""

    def __init__(self, plans: Receiver[Any]) -> None:
        self.plans = plans

    def receive(self) -> list[Any]:
        msg = self.plans.get(timeout=HEARTBEAT_INTERVAL)
        return [] if msg is None else [msg]


def run_pooling_follower(cfg: ServerConfig, rank: int) -> None:
    """A rank > 0: the same forward as rank 0 on its shard; its output is rank 0's."""
    with RoleLoop(cfg, "gpu-worker", rank, title=cfg.worker_role(rank), in_set=False, log=log,
                  inbox=subscribe(plans_address(cfg))) as role:
        tp = role.own(parallel.start(cfg, rank))
        runner = build_pooling_runner(cfg, tp)
        log.info("ready (pid %d): rank %d of %d", os.getpid(), rank, cfg.tensor_parallel_size)

        def run_plan(plan: PoolPlan) -> None:
            role.maybe_fault(plan.plan_id)
            runner.run(plan.requests)

        role.run({PoolPlan: run_plan}, source=_Plans(role.inbox))
