"""The scheduler process.

Receive (requests and aborts from the frontend, `StepDone` from the gpu worker, `StopHit`
and `PlanProcessed` from postproc) → update the request and block state → while the
outstanding-plan rule allows, build the next `StepPlan` and send it.  In async mode one
plan waits queued at the worker, so the worker never idles while we think.
"""
from __future__ import annotations

import logging

from proto.config import ServerConfig
from proto.messages import (AbortRequest, AddRequest, PlanProcessed, Shutdown, StepDone,
                            StopHit, WorkerReady)
from rpc.channels import Receiver, Sender
from scheduler.core import Scheduler, SchedulerParams

log = logging.getLogger("tandem.scheduler")


def make_params(cfg: ServerConfig, ready: WorkerReady) -> SchedulerParams:
    return SchedulerParams(
        num_blocks=ready.num_kv_blocks, block_size=ready.block_size,
        num_steps=cfg.num_scheduler_steps, max_model_len=ready.max_model_len,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        async_mode=cfg.async_postproc, num_postproc_workers=cfg.num_postproc_workers,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens)


def run_scheduler(cfg: ServerConfig) -> None:
    addr = cfg.addresses
    inbox: Receiver = Receiver(addr.scheduler_inbox, bind=True)
    to_worker: Sender = Sender(addr.worker_inbox)
    to_frontend: Sender = Sender(addr.frontend_inbox)
    sched: Scheduler | None = None
    early: list[object] = []  # requests that came before the worker was ready
    try:
        while True:
            msg = inbox.get(timeout=1.0)
            if msg is None:
                continue
            # Everything already waiting first: the next plan should know every finish.
            for m in [msg, *inbox.drain()]:
                if isinstance(m, Shutdown):
                    to_worker.put(m)
                    return
                if isinstance(m, WorkerReady):
                    sched = Scheduler(make_params(cfg, m))
                    log.info("ready: %d KV blocks of %d, max_model_len %d", m.num_kv_blocks,
                             m.block_size, m.max_model_len)
                    to_frontend.put(m)
                    for e in early:
                        dispatch(sched, e, to_frontend)
                    early.clear()
                elif sched is None:
                    early.append(m)
                else:
                    dispatch(sched, m, to_frontend)
            if sched is None:
                continue
            while sched.ready_to_plan():
                to_worker.put(sched.build_plan())
            # Failures come from dispatch and from planning (a request that outgrew the cache).
            for failure in sched.take_failures():
                to_frontend.put(failure)
    finally:
        inbox.close()
        to_worker.close()
        to_frontend.close()


def dispatch(sched: Scheduler, msg: object, to_frontend: Sender) -> None:
    if isinstance(msg, AddRequest):
        rejected = sched.add_request(msg)
        if rejected is not None:
            to_frontend.put(rejected)
    elif isinstance(msg, AbortRequest):
        sched.abort_request(msg.request_id)
    elif isinstance(msg, StepDone):
        sched.on_step_done(msg)
    elif isinstance(msg, StopHit):
        sched.on_stop_hit(msg)
    elif isinstance(msg, PlanProcessed):
        sched.on_plan_processed(msg)
    else:
        log.error("unexpected message %s", type(msg).__name__)
