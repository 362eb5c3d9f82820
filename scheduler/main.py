"""The scheduler process.

Receive (requests and aborts from the frontend, `StepDone` from the gpu worker, `StopHit`
and `PlanProcessed` from postproc) → update the request and block state → while the
outstanding-plan rule allows, build the next `StepPlan` and send it.  In async mode the
next plan is built while the worker runs the current one's last steps (`PlanEnding`) and
waits queued at the worker, so the worker never idles while we think.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tandem_serve.ipc import faults
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.peers import role_watch
from tandem_serve.ipc.process import PlanWatchdog
from tandem_serve.ipc.tracing import TRACER, on_profile_control, set_role
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.messages import (
    AbortRequest,
    AdapterFailed,
    AddRequest,
    EngineStats,
    Heartbeat,
    PlanEnding,
    PlanProcessed,
    ProfileControl,
    Shutdown,
    StepDone,
    StopHit,
    WorkerReady,
)
from tandem_serve.scheduler.core import Scheduler, SchedulerParams

log = logging.getLogger("tandem.scheduler")


def make_params(cfg: ServerConfig, ready: WorkerReady) -> SchedulerParams:
    return SchedulerParams(
        num_blocks=ready.num_kv_blocks, block_size=ready.block_size,
        num_steps=cfg.num_scheduler_steps, max_model_len=ready.max_model_len,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        async_mode=cfg.async_postproc, num_postproc_workers=cfg.num_postproc_workers,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens,
        pace_plans=cfg.pace_plans, vocab_size=ready.vocab_size,
        max_loras=cfg.max_loras if cfg.adapter_cache else 0)


def run_scheduler(cfg: ServerConfig) -> None:
    addr = cfg.addresses
    inbox: Receiver = Receiver(addr.scheduler_inbox, bind=True)
    to_worker: Sender = Sender(addr.worker_inbox)
    to_frontend: Sender = Sender(addr.frontend_inbox)
    sched: Scheduler | None = None
    early: list[object] = []  # requests that came before the worker was ready
    watchdog = PlanWatchdog(cfg.step_timeout)  # supervision: a plan that never ends
    to_supervisor: Sender | None = Sender(addr.supervisor) if addr.supervisor else None
    stats_sent: tuple[float, EngineStats | None] = (0.0, None)
    times = Timings()
    stats_logged: tuple[float, int, float] = (time.monotonic(), 0, 0.0)
    set_role("scheduler")
    peers = role_watch(cfg, "scheduler")
    try:
        while True:
            watch_worker(watchdog, to_supervisor)
            if sched is not None:  # here, not after planning: an idle wake-up sends too
                stats_sent = report_stats(sched, times, to_frontend, stats_sent)
                stats_logged = log_stats(sched, times, stats_logged)
            if peers is not None:
                peers.check(inbox.drained_at)  # on its own: lose the frontend, exit non-zero
            msg = inbox.get(timeout=STATS_INTERVAL)
            if msg is None:
                continue
            # Everything already waiting first: the next plan should know every finish.
            for m in [msg, *inbox.drain()]:
                if isinstance(m, Shutdown):
                    to_worker.put(m)
                    return
                if isinstance(m, Heartbeat):
                    if peers is not None:
                        peers.seen(m)
                    continue
                if isinstance(m, StepDone):
                    watchdog.done(m.plan_id)
                times.on(m, cfg.num_postproc_workers)
                if isinstance(m, WorkerReady):
                    if sched is not None:  # on its own the worker repeats it: keep the first
                        continue
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
                t0 = time.monotonic_ns()
                plan = sched.build_plan()
                TRACER.record("plan", t0, time.monotonic_ns(), plan.plan_id)
                faults.maybe_fire("scheduler", plan.plan_id)  # tests only; no-op otherwise
                watchdog.sent(plan.plan_id)
                to_worker.put(plan)
            # Failures come from dispatch and from planning (a request that outgrew the cache).
            for failure in sched.take_failures():
                to_frontend.put(failure)
    finally:
        inbox.close()
        to_worker.close()
        to_frontend.close()
        if to_supervisor is not None:
            to_supervisor.close()


def watch_worker(watchdog: PlanWatchdog, to_supervisor: Sender | None) -> None:
    """Tell the launcher once when the running plan outlives step_timeout."""
    hung = watchdog.check()
    if hung is not None and to_supervisor is not None:
        log.error("plan %d has run %.1f s (step timeout %.0f s): the gpu worker looks hung",
                  hung.plan_id, hung.seconds, watchdog.timeout)
        to_supervisor.put(hung)


STATS_INTERVAL = 0.2  # seconds; the admin view lags the scheduler by at most this


@dataclass
class Timings:
    """Where the worker's and postproc workers' time went, from StepDone / PlanProcessed."""

    started: float = field(default_factory=time.monotonic)
    num_plans: int = 0
    worker_busy_s: float = 0.0
    forward_s: float = 0.0
    postproc_busy_s: float = 0.0
    steady_busy_s: float = 0.0
    steady_idle_s: float = 0.0

    def on(self, msg: object, num_postproc: int) -> None:
        if isinstance(msg, StepDone):
            self.num_plans += 1
            self.worker_busy_s += msg.wall_time
            self.forward_s += msg.forward_time
            # The wait before a plan with prefill is usually for new requests, not for us.
            if msg.decode_only:
                self.steady_busy_s += msg.wall_time
                self.steady_idle_s += msg.idle_time
        elif isinstance(msg, PlanProcessed):
            self.postproc_busy_s += msg.busy_s / num_postproc


STATS_LOG_INTERVAL = 10.0  # seconds between the one-line stats log entries


def log_stats(sched: Scheduler, times: Timings,
              last: tuple[float, int, float]) -> tuple[float, int, float]:
    """One line per interval, like SGLang's decode log: load, speed, KV use, device busy."""
    now = time.monotonic()
    if now - last[0] < STATS_LOG_INTERVAL:
        return last
    s = sched.stats
    span = now - last[0]
    busy = (times.worker_busy_s - last[2]) / span
    kv = 1.0 - s.num_free_blocks / max(sched.params.num_blocks, 1)
    if s.num_running or s.num_waiting or s.tokens_delivered != last[1]:
        log.info("running %d, waiting %d, gen %.1f tok/s, KV %.1f%%, device busy %.1f%%, "
                 "preemptions %d", s.num_running, s.num_waiting,
                 (s.tokens_delivered - last[1]) / span, 100 * kv, 100 * busy,
                 s.num_preemptions)
    return now, s.tokens_delivered, times.worker_busy_s


def report_stats(sched: Scheduler, times: Timings, to_frontend: Sender,
                 sent: tuple[float, EngineStats | None]) -> tuple[float, EngineStats | None]:
    """Send the frontend's admin counters every STATS_INTERVAL."""
    now = time.monotonic()
    if now - sent[0] < STATS_INTERVAL:
        return sent
    s = sched.stats
    # Sent even when nothing changed: the clock (uptime_s) is part of what readers need.
    stats = EngineStats(s.num_free_blocks, sched.params.num_blocks, s.num_running,
                        s.num_waiting, s.num_preemptions, s.prefix_hit_tokens,
                        s.prefix_query_tokens, s.tokens_delivered, s.tokens_after_finish,
                        now - times.started, times.num_plans, times.worker_busy_s,
                        times.forward_s, times.postproc_busy_s, times.steady_busy_s,
                        times.steady_idle_s, sched.take_queue_times(),
                        list(s.loaded_adapters), s.adapter_loads, list(s.running_adapters),
                        list(s.waiting_adapters))
    to_frontend.put(stats)
    return now, stats


def dispatch(sched: Scheduler, msg: object, to_frontend: Sender) -> None:
    if isinstance(msg, AddRequest):
        rejected = sched.add_request(msg)
        if rejected is not None:
            to_frontend.put(rejected)
    elif isinstance(msg, ProfileControl):
        on_profile_control(msg, to_frontend)
    elif isinstance(msg, AbortRequest):
        sched.abort_request(msg.request_id)
    elif isinstance(msg, PlanEnding):
        sched.on_plan_ending(msg)
    elif isinstance(msg, StepDone):
        sched.on_step_done(msg)
    elif isinstance(msg, StopHit):
        sched.on_stop_hit(msg)
    elif isinstance(msg, AdapterFailed):
        log.warning("plan %d: %s; failing %d requests", msg.plan_id, msg.message,
                    len(msg.request_ids))
        sched.on_adapter_failed(msg)
    elif isinstance(msg, PlanProcessed):
        sched.on_plan_processed(msg)
    else:
        log.error("unexpected message %s", type(msg).__name__)
