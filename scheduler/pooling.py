"""The scheduler's side of `--runner pooling`: a queue of prefill-only requests, sent to the
gpu worker in batches under a token budget.

A batch is padded to its longest row on the device (dense attention, DESIGN.md section 24),
so the budget counts rows times the longest row, not the sum of the lengths: a long text
then waits for a batch of its own rather than padding many short ones.  Requests go in
arrival order; up to `AHEAD` batches are at the worker at once, so the next one is already
queued there when a forward ends and the device never waits for us.  No KV blocks: nothing
outlives its forward.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from tandem_serve.proto.monitor_messages import EngineStats
from tandem_serve.proto.pooling_messages import PoolDone, PoolPlan, PoolRequest
from tandem_serve.proto.request_messages import RequestRejected

AHEAD = 2  # batches at the worker at once: one running, one waiting
DEFAULT_POOLING_TOKENS = {"cpu": 4096, "cuda": 16384}  # padded tokens per batch


@dataclass(frozen=True)
class PoolingParams:
    max_num_seqs: int
    max_batch_tokens: int
    max_queued_requests: int


class PoolScheduler:
    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.waiting: deque[PoolRequest] = deque()
        self.aborted: set[int] = set()
        self.in_flight: dict[int, int] = {}  # plan id -> its requests, sent and not done
        self.queue_times: list[float] = []  # arrival to batch, since the last report
        self.started = time.monotonic()
        self._plan_ids = itertools.count()
        self.num_plans = 0
        self.num_requests = 0
        self.num_tokens = 0
        self.forward_s = 0.0

    def add(self, req: PoolRequest) -> RequestRejected | None:
        if len(self.waiting) >= self.params.max_queued_requests:
            return RequestRejected(req.request_id, f"too many queued requests (max "
                                   f"{self.params.max_queued_requests}, "
                                   f"--max-queued-requests); try again later")
        self.waiting.append(req)
        return None

    def abort(self, request_id: int) -> None:
        """Only a waiting request can go: one in a batch costs nothing more to finish."""
        if any(r.request_id == request_id for r in self.waiting):
            self.aborted.add(request_id)

    def on_done(self, msg: PoolDone) -> None:
        self.in_flight.pop(msg.plan_id, None)
        self.num_plans += 1
        self.num_requests += msg.num_requests
        self.num_tokens += msg.num_tokens
        self.forward_s += msg.forward_time

    def ready_to_plan(self) -> bool:
        self._skip_aborted()
        return bool(self.waiting) and len(self.in_flight) < AHEAD

    def build_plan(self) -> PoolPlan:
        """The longest arrival-order prefix of the queue under the budget (at least one)."""
        plan = PoolPlan(next(self._plan_ids))
        longest = 0
        while self.waiting and len(plan.requests) < self.params.max_num_seqs:
            req = self.waiting[0]
            if req.request_id in self.aborted:
                self.aborted.discard(req.request_id)
                self.waiting.popleft()
                continue
            width = max(longest, len(req.prompt_ids))
            if plan.requests and width * (len(plan.requests) + 1) > self.params.max_batch_tokens:
                break
            plan.requests.append(self.waiting.popleft())
            longest = width
        self.in_flight[plan.plan_id] = len(plan.requests)
        now = time.monotonic()
        self.queue_times += [now - r.arrival_time for r in plan.requests]
        return plan

    def stats(self) -> EngineStats:
        """The admin counters (and vLLM's running / waiting gauges): no KV blocks."""
        times, self.queue_times = self.queue_times, []
        return EngineStats(num_free_blocks=0, num_total_blocks=0,
                           num_running=sum(self.in_flight.values()),
                           num_waiting=max(0, len(self.waiting) - len(self.aborted)),
                           num_preemptions=0, prefix_hit_tokens=0, prefix_query_tokens=0,
                           tokens_delivered=0, tokens_after_finish=0,
                           uptime_s=time.monotonic() - self.started, num_plans=self.num_plans,
                           worker_busy_s=self.forward_s, forward_s=self.forward_s,
                           queue_times_s=times)

    def _skip_aborted(self) -> None:
        while self.waiting and self.waiting[0].request_id in self.aborted:
            self.aborted.discard(self.waiting.popleft().request_id)
