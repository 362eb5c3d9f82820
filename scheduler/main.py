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
from collections.abc import Callable
from typing import Any

from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.process import PlanWatchdog
from tandem_serve.ipc.role_loop import Handler, Inbox, RoleLoop
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto.adapter_messages import AdapterFailed
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.control_messages import EngineControl
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedLost, GuidedTable, GuidedWanted
from tandem_serve.proto.kv_events import parse_kv_events
from tandem_serve.proto.monitor_messages import ProfileControl
from tandem_serve.proto.plan_messages import PlanEnding, StepDone, WorkerReady
from tandem_serve.proto.pooling_messages import PoolDone, PoolRequest
from tandem_serve.proto.request_messages import AbortRequest, AddRequest
from tandem_serve.proto.speculative import parse_speculative
from tandem_serve.proto.token_messages import PlanProcessed, StopHit
from tandem_serve.scheduler.budget import default_tokens
from tandem_serve.scheduler.control import ControlHandler
from tandem_serve.scheduler.core import Scheduler, SchedulerParams
from tandem_serve.scheduler.kv.events import KvEventPublisher
from tandem_serve.scheduler.pooling import (
    DEFAULT_POOLING_TOKENS,
    PoolingParams,
    PoolScheduler,
)
from tandem_serve.scheduler.stats import STATS_INTERVAL, Reports

log = logging.getLogger("tandem.scheduler")

# What a message does to the scheduler (which exists once the gpu worker is ready).
OnScheduler = Callable[[Scheduler, Any], object]


def prefix_caching(cfg: ServerConfig, ready: WorkerReady) -> bool:
    """Off for a LongRoPE model that may run past its original context: the same prompt
    tokens then have KV rotated with other factors depending on the request's length, and a
    block hash of the tokens alone would share the wrong KV."""
    if cfg.enable_prefix_caching and ready.recurrent_state and not ready.state_checkpoint_blocks:
        log.warning("prefix caching is off: the model's linear-attention layers keep a "
                    "recurrent state per request that the worker does not checkpoint "
                    "(speculative decoding is on)")
        return False
    if cfg.enable_prefix_caching and 0 < ready.long_rope_from < ready.max_model_len:
        log.warning("prefix caching is off: LongRoPE rotates histories longer than %d tokens "
                    "with other factors (--max-model-len %d keeps it on)",
                    ready.long_rope_from, ready.long_rope_from)
        return False
    return cfg.enable_prefix_caching


def make_params(cfg: ServerConfig, ready: WorkerReady) -> SchedulerParams:
    tokens = cfg.max_num_batched_tokens or default_tokens(ready.device_type, cfg.prefill_phase)
    spec = parse_speculative(cfg.speculative_config)
    return SchedulerParams(
        num_blocks=ready.num_kv_blocks, block_size=ready.block_size,
        num_steps=cfg.num_scheduler_steps, max_model_len=ready.max_model_len,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=tokens,
        prefill_phase=cfg.prefill_phase, attention_tokens=ready.attention_tokens,
        async_mode=cfg.async_postproc, num_postproc_workers=cfg.num_postproc_workers,
        enable_prefix_caching=prefix_caching(cfg, ready),
        max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens,
        pace_plans=cfg.pace_plans, vocab_size=ready.vocab_size,
        max_loras=cfg.max_loras if cfg.adapter_cache else 0,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        scheduling_policy=cfg.scheduling_policy,
        num_host_blocks=ready.num_host_blocks,
        record_kv_events=parse_kv_events(cfg.kv_events_config).publishing,
        prefix_granularity=max(1, ready.state_checkpoint_blocks))


def run_scheduler(cfg: ServerConfig) -> None:
    addr = cfg.addresses
    to_frontend: Sender = Sender(addr.frontend_inbox)
    with RoleLoop(cfg, "scheduler", log=log, reply=to_frontend,
                  inbox=Receiver(addr.scheduler_inbox, bind=True)) as role:
        to_worker: Sender = role.own(Sender(addr.worker_inbox))
        to_supervisor: Sender | None = role.own(Sender(addr.supervisor)) if addr.supervisor \
            else None
        loop = SchedulerLoop(cfg, role, to_worker, to_frontend, to_supervisor)
        # Everything already waiting first: the next plan should know every finish.
        role.run(loop.handlers(), source=Inbox(role.inbox, STATS_INTERVAL, drain=True),
                 work=loop.work, on_shutdown=to_worker.put)


class SchedulerLoop:
    """The scheduler's handlers and its work after each receive: plans, supervision of the
    worker, statistics."""

    def __init__(self, cfg: ServerConfig, role: RoleLoop, to_worker: Sender,
                 to_frontend: Sender, to_supervisor: Sender | None) -> None:
        self.cfg, self.role = cfg, role
        self.to_worker, self.to_frontend, self.to_supervisor = to_worker, to_frontend, \
            to_supervisor
        self.sched: Scheduler | None = None  # once the worker says how much KV it has
        self.early: list[tuple[OnScheduler, object]] = []  # what came before that
        self.watchdog = PlanWatchdog(cfg.step_timeout)  # supervision: a plan that never ends
        self.reports = Reports(to_frontend)
        # --runner pooling: batches of prefill-only requests instead of plans (pooling.py).
        self.pool: PoolScheduler | None = None
        self.pool_ready = False  # batches go once the worker said which device it runs on
        self.pool_reported = 0.0  # when its EngineStats last went to the frontend
        if cfg.runner == "pooling":
            self.pool = PoolScheduler(self._pooling_params("cpu"))
        self.kv_events: KvEventPublisher | None = None  # --kv-events-config

    def handlers(self) -> dict[type, Handler]:
        if self.cfg.runner == "pooling":
            return self.pooling_handlers()
        on_scheduler: dict[type, OnScheduler] = {
            AddRequest: self.add_request,
            AbortRequest: lambda sched, msg: sched.abort_request(msg.request_id),
            PlanEnding: Scheduler.on_plan_ending,
            StepDone: Scheduler.on_step_done,
            StopHit: Scheduler.on_stop_hit,
            AdapterFailed: self.adapter_failed,
            GuidedTable: Scheduler.on_constraint,
            GuidedGrammar: Scheduler.on_constraint,
            GuidedLost: Scheduler.on_constraint_lost,
            PlanProcessed: Scheduler.on_plan_processed,
            ProfileControl: lambda sched, msg: self.role.profile(msg),
            EngineControl: lambda sched, msg: self.controls(sched).on_control(msg),
        }
        return {WorkerReady: self.worker_ready,
                **{kind: self._received(handle) for kind, handle in on_scheduler.items()}}

    def _pooling_params(self, device_type: str) -> PoolingParams:
        tokens = self.cfg.max_num_batched_tokens or \
            DEFAULT_POOLING_TOKENS.get(device_type, DEFAULT_POOLING_TOKENS["cpu"])
        return PoolingParams(self.cfg.max_num_seqs, tokens, self.cfg.max_queued_requests)

    def pooling_handlers(self) -> dict[type, Handler]:
        def add(msg: PoolRequest) -> None:
            assert self.pool is not None
            rejected = self.pool.add(msg)
            if rejected is not None:
                self.to_frontend.put(rejected)

        def done(msg: PoolDone) -> None:
            assert self.pool is not None
            self.watchdog.done(msg.plan_id)
            self.pool.on_done(msg)

        def abort(msg: AbortRequest) -> None:
            assert self.pool is not None
            self.pool.abort(msg.request_id)

        return {WorkerReady: self.worker_ready, PoolRequest: add, PoolDone: done,
                AbortRequest: abort, ProfileControl: self.role.profile}

    def _received(self, handle: OnScheduler) -> Handler:
        """A message is counted at once, and handled once the worker is ready."""
        def receive(msg: Any) -> None:
            if isinstance(msg, StepDone):
                self.watchdog.done(msg.plan_id)
            self.reports.times.on(msg, self.cfg.num_postproc_workers)
            if self.sched is None:
                self.early.append((handle, msg))
            else:
                handle(self.sched, msg)
        return receive

    def worker_ready(self, msg: WorkerReady) -> None:
        if self.sched is not None or self.pool_ready:  # on its own the worker repeats
            return  # it: keep the first
        if self.pool is not None:
            self.pool.params = self._pooling_params(msg.device_type)
            self.pool_ready = True
            log.info("ready (pooling): up to %d padded tokens and %d requests per batch",
                     self.pool.params.max_batch_tokens, self.pool.params.max_num_seqs)
            self.to_frontend.put(msg)
            return
        self.sched = Scheduler(make_params(self.cfg, msg))
        params = self.sched.params
        if params.record_kv_events:
            self.kv_events = self.role.own(KvEventPublisher(
                parse_kv_events(self.cfg.kv_events_config), params.block_size))
        if params.num_host_blocks and params.enable_prefix_caching:
            log.info("host KV tier: %d blocks of %d tokens", params.num_host_blocks,
                     params.block_size)
        elif params.num_host_blocks:
            log.warning("host KV tier unused: prefix caching is off")
        log.info("ready: %d KV blocks of %d, max_model_len %d, %d tokens per %s",
                 msg.num_kv_blocks, msg.block_size, msg.max_model_len,
                 params.max_num_batched_tokens, "plan" if params.prefill_phase else "step")
        self.to_frontend.put(msg)
        for handle, early in self.early:
            handle(self.sched, early)
        self.early.clear()

    def controls(self, sched: Scheduler) -> ControlHandler:
        """The rollout controls over this scheduler (scheduler/control.py)."""
        return ControlHandler(sched.gate, sched.reset_prefix_cache, self.to_frontend.put,
                              self.to_worker.put)

    def add_request(self, sched: Scheduler, msg: AddRequest) -> None:
        rejected = sched.add_request(msg)
        if rejected is not None:
            self.to_frontend.put(rejected)

    @staticmethod
    def adapter_failed(sched: Scheduler, msg: AdapterFailed) -> None:
        log.warning("plan %d: %s; failing %d requests", msg.plan_id, msg.message,
                    len(msg.request_ids))
        sched.on_adapter_failed(msg)

    def work(self) -> None:
        if self.pool is not None and self.pool_ready:
            while self.pool.ready_to_plan():
                plan = self.pool.build_plan()
                self.role.maybe_fault(plan.plan_id)
                self.watchdog.sent(plan.plan_id)
                self.to_worker.put(plan)
            now = time.monotonic()
            if now - self.pool_reported >= STATS_INTERVAL:
                self.pool_reported = now
                self.to_frontend.put(self.pool.stats())
        if self.sched is not None:
            self.plan(self.sched)
        self.watch_worker()
        if self.sched is not None:  # after every receive: an idle wake-up sends them too
            self.reports.tick(self.sched)

    def plan(self, sched: Scheduler) -> None:
        while sched.ready_to_plan():
            t0 = time.monotonic_ns()
            plan = sched.build_plan()
            TRACER.record("plan", t0, time.monotonic_ns(), plan.plan_id)
            self.role.maybe_fault(plan.plan_id)
            self.watchdog.sent(plan.plan_id)
            self.to_worker.put(plan)
        if sched.gate.pending:  # behind the plans just sent, once nothing runs
            self.controls(sched).forward_ready(len(sched.state.running))
        # Failures come from dispatch and from planning (a request that outgrew the cache).
        for failure in sched.take_failures():
            self.to_frontend.put(failure)
        if self.kv_events is not None:  # what planning (or a cache reset) changed
            self.kv_events.publish(sched.take_kv_events())
        wanted = sched.take_wanted_constraints()
        if wanted:
            self.to_frontend.put(GuidedWanted(wanted))

    def watch_worker(self) -> None:
        """Tell the launcher once when the running plan outlives step_timeout."""
        hung = self.watchdog.check()
        if hung is not None and self.to_supervisor is not None:
            log.error("plan %d has run %.1f s (step timeout %.0f s): the gpu worker looks hung",
                      hung.plan_id, hung.seconds, self.watchdog.timeout)
            self.to_supervisor.put(hung)
