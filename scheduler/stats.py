"""What the scheduler reports about the engine: the frontend's admin counters
(`EngineStats`, every STATS_INTERVAL) and a one-line log every STATS_LOG_INTERVAL."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tandem_serve.ipc.channels import Sender
from tandem_serve.proto.monitor_messages import EngineStats
from tandem_serve.proto.plan_messages import StepDone
from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.core import Scheduler

log = logging.getLogger("tandem.scheduler")

STATS_INTERVAL = 0.2  # seconds; the admin view lags the scheduler by at most this
STATS_LOG_INTERVAL = 10.0  # seconds between the one-line stats log entries


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
    spec: tuple[int, int, int] = (0, 0, 0)  # drafts, draft tokens, accepted tokens
    spec_per_pos: list[int] = field(default_factory=list)  # accepted by draft position

    def on(self, msg: object, num_postproc: int) -> None:
        if isinstance(msg, StepDone):
            self.num_plans += 1
            self.worker_busy_s += msg.wall_time
            self.forward_s += msg.forward_time
            drafts, tokens, accepted = self.spec
            self.spec = (drafts + msg.num_drafts, tokens + msg.num_draft_tokens,
                         accepted + msg.num_accepted_tokens)
            for j, n in enumerate(msg.num_accepted_per_pos):
                if j == len(self.spec_per_pos):
                    self.spec_per_pos.append(0)
                self.spec_per_pos[j] += n
            # The wait before a plan with prefill is usually for new requests, not for us.
            if msg.decode_only:
                self.steady_busy_s += msg.wall_time
                self.steady_idle_s += msg.idle_time
        elif isinstance(msg, PlanProcessed):
            self.postproc_busy_s += msg.busy_s / num_postproc


class Reports:
    """The timings, and when the counters were last sent and the last log line written."""

    def __init__(self, to_frontend: Sender) -> None:
        self.to_frontend = to_frontend
        self.times = Timings()
        self.sent: tuple[float, EngineStats | None] = (0.0, None)
        self.logged: tuple[float, int, float] = (time.monotonic(), 0, 0.0)

    def tick(self, sched: Scheduler) -> None:
        """Send and log what is due."""
        self.sent = report_stats(sched, self.times, self.to_frontend, self.sent)
        self.logged = log_stats(sched, self.times, self.logged)


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
                        list(s.waiting_adapters), *times.spec, list(times.spec_per_pos),
                        s.external_query_tokens, s.external_hit_tokens, s.host_blocks_used,
                        sched.params.num_host_blocks, queue_time_ids=sched.take_queue_ids())
    to_frontend.put(stats)
    return now, stats
