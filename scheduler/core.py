"""The scheduler's pure logic: admission, KV block accounting, plans, preemption.

No sockets, no processes: `scheduler/main.py` calls one method per message it receives and,
while `ready_to_plan()`, sends `build_plan()` to the gpu worker.

The scheduler predicts every request's state at the worker from counts alone (see
`scheduler/requests.py`).  Plans run in order at the worker and apply their drops and
preemptions before any forward, so blocks freed while building plan n (or when a late finish
arrives) may go to other requests in plan n: whatever earlier plans still write into them
happens before.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from proto.messages import (
    AddRequest,
    ContinueRequest,
    FinishReason,
    NewRequest,
    PlanEnding,
    PlanProcessed,
    RequestFailed,
    RequestRejected,
    StepDone,
    StepPlan,
    StopHit,
)
from scheduler.block_manager import BlockManager, prompt_block_hashes
from scheduler.requests import Request, RequestStatus, TokenLedger

# One plan running at the worker and one queued behind it: the worker never waits for the
# scheduler, and a finish learned from StepDone(n) can only be inside the queued plan n+1.
# With paced planning plan n+1 is built once the worker says plan n is ending (PlanEnding).
MAX_OUTSTANDING_ASYNC = 2


@dataclass(frozen=True)
class SchedulerParams:
    num_blocks: int
    block_size: int
    num_steps: int
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_mode: bool = True
    num_postproc_workers: int = 2
    enable_prefix_caching: bool = True
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    # Async mode: build plan n+1 only once plan n is ending (PlanEnding) or done, not as soon
    # as plan n is sent, so that requests arriving during plan n still make plan n+1.
    pace_plans: bool = False


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tokens_delivered: int
    tokens_after_finish: int
    plans_outstanding: int
    prefix_hit_blocks: int = 0
    prefix_queries: int = 0
    num_plans: int = 0
    num_rejected: int = 0
    num_failed: int = 0


@dataclass
class _PlanProgress:
    step_done: bool = False
    ending: bool = False  # the worker is running its last steps (PlanEnding)
    processed_by: set[int] = field(default_factory=set)


@dataclass
class _Draft:
    """The plan being built."""

    plan_id: int
    budget: int  # tokens left under max_num_batched_tokens
    new: list[NewRequest] = field(default_factory=list)
    cont: list[ContinueRequest] = field(default_factory=list)
    preempt: list[int] = field(default_factory=list)
    chunks: dict[int, tuple[Request, int]] = field(default_factory=dict)  # id -> prefill tokens

    def schedule(self, req: Request, num_prefill: int) -> None:
        # A request whose prefill is done decodes in this plan too: one token of the budget.
        decodes = num_prefill == req.prefill_left
        self.chunks[req.request_id] = (req, num_prefill)
        self.budget -= num_prefill + int(decodes)

    def has(self, req: Request) -> bool:
        return req.request_id in self.chunks


class Scheduler:
    def __init__(self, params: SchedulerParams) -> None:
        if params.num_steps < 1 or params.max_num_batched_tokens < 1 or params.max_num_seqs < 1:
            raise ValueError(f"num_steps, max_num_batched_tokens and max_num_seqs must be >= 1: "
                             f"{params}")
        self.params = params
        self._blocks = BlockManager(params.num_blocks, params.block_size,
                                    params.enable_prefix_caching)
        self._requests: dict[int, Request] = {}  # waiting, preempted and running
        self._waiting: deque[Request] = deque()  # preempted ones at the front
        self._running: list[Request] = []  # oldest admission first; preempted newest first
        self._waiting_tokens = 0
        self._pending_drops: list[int] = []
        self._plans: dict[int, _PlanProgress] = {}  # built and not yet done and processed
        self._next_plan_id = 0
        self._failures: list[RequestFailed] = []
        self._ledger = TokenLedger()
        self._num_preemptions = 0
        self._num_rejected = 0
        self._num_failed = 0
        self._prefix_queries = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_blocks = 0
        # Arrival (the frontend's clock: one monotonic clock per host) to first scheduling.
        self._queue_times: list[float] = []
        self.clock = time.monotonic  # tests replace it

    # ================================================================== messages in

    def add_request(self, msg: AddRequest) -> RequestRejected | None:
        """Queue a request; a RequestRejected (limit named) when admission control says no.

        A request that can never run (empty prompt, prompt >= max_model_len, max_new_tokens < 1,
        more KV than the whole cache) is not rejected but failed: see `take_failures`.
        """
        prompt_ids = np.ascontiguousarray(msg.prompt_ids, dtype=np.int32)
        rejection = self._admission_refusal(msg.request_id, len(prompt_ids))
        if rejection is not None:
            self._num_rejected += 1
            return RequestRejected(msg.request_id, rejection)
        req = Request(msg.request_id, prompt_ids, msg.sampling, msg.arrival_time,
                      self.params.max_model_len)
        problem = self._unrunnable(req)
        if problem is not None:
            self._record_failure(req, problem)
            return None
        if self.params.enable_prefix_caching:
            req.prompt_block_hashes = prompt_block_hashes(prompt_ids, self.params.block_size)
        self._requests[req.request_id] = req
        self._waiting.append(req)
        self._waiting_tokens += req.prompt_len
        return None

    def abort_request(self, request_id: int,
                      reason: FinishReason = FinishReason.CANCELLED) -> None:
        req = self._requests.get(request_id)
        self._ledger.cut(request_id)
        if req is not None:
            self._finish(req, reason)

    def on_step_done(self, msg: StepDone) -> None:
        progress = self._progress(msg.plan_id)
        if progress is None:  # a duplicate of a plan already retired
            return
        progress.step_done = True
        produced = zip(msg.request_ids.tolist(), msg.num_tokens.tolist(), strict=True)
        for request_id, num_tokens in produced:
            self._ledger.add_produced(request_id, num_tokens)
        finished = zip(msg.finished_ids.tolist(), msg.finish_reasons.tolist(), strict=True)
        for request_id, reason in finished:
            req = self._requests.get(request_id)
            if req is not None:  # else finished by counts, aborted, or reported again
                self._finish(req, FinishReason(reason))
        self._retire_complete_plans()

    def on_plan_ending(self, msg: PlanEnding) -> None:
        progress = self._progress(msg.plan_id)
        if progress is not None:
            progress.ending = True

    def on_stop_hit(self, msg: StopHit) -> None:
        self._ledger.cut(msg.request_id, msg.num_tokens)
        req = self._requests.get(msg.request_id)
        if req is not None:
            self._finish(req, FinishReason.STOP_SEQUENCE)

    def on_plan_processed(self, msg: PlanProcessed) -> None:
        if not 0 <= msg.worker_index < self.params.num_postproc_workers:
            raise ValueError(f"PlanProcessed from postproc worker {msg.worker_index}; there are "
                             f"{self.params.num_postproc_workers}")
        progress = self._progress(msg.plan_id)
        if progress is not None:
            progress.processed_by.add(msg.worker_index)
            self._retire_complete_plans()

    def take_queue_times(self) -> list[float]:
        """Seconds from arrival to first scheduling of each request first scheduled since the
        previous call (a resumed request counts once, at its first start)."""
        times, self._queue_times = self._queue_times, []
        return times

    def take_failures(self) -> list[RequestFailed]:
        failures, self._failures = self._failures, []
        return failures

    # ================================================================== planning

    def ready_to_plan(self) -> bool:
        return self._pipeline_has_room() and self._has_work()

    def build_plan(self) -> StepPlan:
        """Running requests first (decodes, then prefill chunks), then the waiting queue."""
        if not self.ready_to_plan():
            raise RuntimeError("build_plan() called while ready_to_plan() is False")
        draft = _Draft(self._next_plan_id, self.params.max_num_batched_tokens)
        self._continue_decodes(draft)
        self._continue_prefills(draft)
        if not draft.preempt:  # blocks ran short for running requests: admit nobody now
            self._admit_waiting(draft)
        drop = self._take_pending_drops(draft.plan_id)
        self._advance(draft)
        return self._issue(draft, drop)

    def _continue_decodes(self, draft: _Draft) -> None:
        for req in list(self._running):
            if req.status is RequestStatus.RUNNING and not req.is_prefilling:
                self._continue_decode(req, draft)

    def _continue_decode(self, req: Request, draft: _Draft) -> None:
        # The worker decodes every running request K times (capped by its limits) whether
        # the plan names it or not: it gets its lookahead blocks, or leaves the batch now.
        positions = self._positions_after(req, req.num_computed)
        if not self._fits_alone(req, positions):
            return
        new_blocks = self._grow(req, positions, draft)
        if new_blocks is None:
            self._preempt(req, draft)
            return
        draft.schedule(req, 0)
        if new_blocks:
            draft.cont.append(ContinueRequest(req.request_id, new_blocks))

    def _continue_prefills(self, draft: _Draft) -> None:
        for req in list(self._running):
            if draft.budget <= 0:
                return
            if req.status is RequestStatus.RUNNING and req.is_prefilling and not draft.has(req):
                self._continue_prefill(req, draft)

    def _continue_prefill(self, req: Request, draft: _Draft) -> None:
        num_prefill = self._chunk(req.prefill_left, draft.budget)
        while num_prefill is not None:
            positions = self._positions_after(req, req.num_computed + num_prefill)
            new_blocks = self._grow(req, positions, draft)
            if new_blocks is not None:
                draft.schedule(req, num_prefill)
                draft.cont.append(ContinueRequest(req.request_id, new_blocks, num_prefill))
                return
            num_prefill = self._chunk_that_fits(req, num_prefill)

    def _admit_waiting(self, draft: _Draft) -> None:
        while (self._waiting and draft.budget > 0
               and len(self._running) < self.params.max_num_seqs):
            if not self._admit(self._waiting[0], draft):
                return  # first come, first served: nobody overtakes the head of the queue

    def _admit(self, req: Request, draft: _Draft) -> bool:
        """Start (or resume) the head of the queue; False when it has to wait."""
        if not self._fits_alone(req, self._positions_after(req, req.num_tokens - 1)):
            return True
        # Prompt logprobs need every prompt position computed: no cached prefix for those.
        hits = [] if req.sampling.prompt_logprobs else self._blocks.lookup(
            self._cacheable_hashes(req))
        num_cached = len(hits) * self.params.block_size
        num_prefill = self._chunk(req.num_tokens - 1 - num_cached, draft.budget)
        if num_prefill is None:
            return False
        positions = self._positions_after(req, num_cached + num_prefill)
        num_new = self._blocks.blocks_for(positions) - len(hits)
        if num_new > self._blocks.num_free - self._blocks.num_evictable(hits):
            return False
        self._blocks.take(hits)
        req.blocks = hits + self._blocks.allocate(num_new)
        if not req.known_to_worker:
            self._queue_times.append(max(0.0, self.clock() - req.arrival_time))
        self._start_running(req, num_cached, len(hits))
        draft.schedule(req, num_prefill)
        draft.new.append(self._new_request_message(req, num_cached, num_prefill))
        req.known_to_worker = True
        return True

    def _advance(self, draft: _Draft) -> None:
        """Predict the worker's counts after this plan; register filled prompt blocks."""
        for req, num_prefill in draft.chunks.values():
            req.num_computed += num_prefill
            if not req.is_prefilling:
                steps = self._steps(req)
                req.num_tokens += steps
                req.num_computed += steps
            self._register_filled_blocks(req)
            finish = req.count_finish()
            if finish is not None:  # the worker stops it in this plan: drop it in the next
                self._finish(req, finish)

    def _issue(self, draft: _Draft, drop: list[int]) -> StepPlan:
        self._plans[draft.plan_id] = _PlanProgress()
        self._next_plan_id += 1
        return StepPlan(
            plan_id=draft.plan_id,
            num_steps=self.params.num_steps,
            new=draft.new,
            cont=draft.cont,
            drop=drop,
            preempt=draft.preempt,
            publish_per_step=self.params.async_mode,
        )

    # ================================================================== planning helpers

    def _steps(self, req: Request) -> int:
        """Decode steps the worker runs for `req` in one plan: it stops at its limits."""
        return min(self.params.num_steps, req.steps_left)

    def _positions_after(self, req: Request, num_computed: int) -> int:
        """KV positions `req` needs once a prefill reaches `num_computed`.

        Once the prompt is done the same plan decodes, so the decode lookahead is included.
        """
        prefill_done = num_computed == req.num_tokens - 1
        return num_computed + (self._steps(req) if prefill_done else 0)

    @staticmethod
    def _chunk(prefill_left: int, budget: int) -> int | None:
        """The prefill chunk the token budget allows; None when it allows no progress."""
        if prefill_left + 1 <= budget:  # the whole rest, plus the decode step that follows
            return prefill_left
        num_prefill = min(prefill_left - 1, budget)
        return num_prefill if num_prefill > 0 else None

    def _chunk_that_fits(self, req: Request, num_prefill: int) -> int | None:
        """A smaller chunk that does not complete the prompt and fits in the free blocks."""
        room = (len(req.blocks) + self._blocks.num_free) * self.params.block_size
        smaller = min(num_prefill, req.prefill_left - 1, room - req.num_computed)
        return smaller if 0 < smaller < num_prefill else None

    def _grow(self, req: Request, positions: int, draft: _Draft) -> list[int] | None:
        """Blocks for `positions`, preempting newer unscheduled requests; None if that fails."""
        num_new = max(0, self._blocks.blocks_for(positions) - len(req.blocks))
        while num_new > self._blocks.num_free:
            victim = self._newest_unscheduled(draft)
            if victim is req:
                return None
            self._preempt(victim, draft)
        new_blocks = self._blocks.allocate(num_new)
        req.blocks.extend(new_blocks)
        return new_blocks

    def _newest_unscheduled(self, draft: _Draft) -> Request:
        # Callers are themselves running and unscheduled, so there always is one.
        return next(req for req in reversed(self._running) if not draft.has(req))

    def _fits_alone(self, req: Request, positions: int) -> bool:
        """False (and the request failed) when even the whole cache is too small for it."""
        needed = self._blocks.blocks_for(positions)
        if needed <= self.params.num_blocks:
            return True
        self._fail(req, f"request {req.request_id} needs {needed} KV blocks of "
                        f"{self.params.block_size} tokens for {positions} positions; the whole "
                        f"cache has num_blocks={self.params.num_blocks}")
        return False

    def _cacheable_hashes(self, req: Request) -> list[bytes]:
        # The last history token is always computed by a decode step, so at most
        # len(history) - 1 tokens may come from the cache.
        max_blocks = (req.num_tokens - 1) // self.params.block_size
        return req.prompt_block_hashes[:max_blocks]

    def _register_filled_blocks(self, req: Request) -> None:
        # Plans run in order, so a request hitting these blocks in a later plan reads them
        # after this plan wrote them.  Registered at the end of planning, they cannot be hit
        # by another request of this same plan, whose forward may run alongside.
        filled = min(req.num_computed // self.params.block_size, len(req.prompt_block_hashes))
        for index in range(req.num_registered_blocks, filled):
            self._blocks.register(req.blocks[index], req.prompt_block_hashes[index])
        req.num_registered_blocks = max(req.num_registered_blocks, filled)

    def _new_request_message(self, req: Request, num_cached: int,
                             num_prefill: int) -> NewRequest:
        if req.known_to_worker:  # resuming: the worker kept the history and sampling params
            return NewRequest(req.request_id, np.empty(0, dtype=np.int32), None,
                              list(req.blocks), num_cached, num_prefill, resume=True)
        return NewRequest(req.request_id, req.prompt_ids, req.sampling, list(req.blocks),
                          num_cached, num_prefill)

    # ================================================================== state changes

    def _start_running(self, req: Request, num_cached: int, num_hit_blocks: int) -> None:
        self._waiting.popleft()
        self._waiting_tokens -= req.prompt_len
        self._running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed = num_cached
        req.num_registered_blocks = num_hit_blocks
        self._ledger.open(req.request_id)
        if self.params.enable_prefix_caching:
            self._prefix_queries += 1
            self._prefix_query_tokens += req.num_tokens
            self._prefix_hit_blocks += num_hit_blocks

    def _preempt(self, req: Request, draft: _Draft) -> None:
        # Recompute, not swap: the worker frees the KV and keeps the token history.
        self._running.remove(req)
        self._blocks.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(req)
        self._waiting_tokens += req.prompt_len
        draft.preempt.append(req.request_id)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
            self._waiting_tokens -= req.prompt_len
        self._blocks.free(req.blocks)
        req.blocks = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
        if req.known_to_worker:
            self._pending_drops.append(req.request_id)

    def _fail(self, req: Request, message: str) -> None:
        self._ledger.cut(req.request_id)
        self._finish(req, FinishReason.TOKEN_LIMIT)
        self._record_failure(req, message)

    def _record_failure(self, req: Request, message: str) -> None:
        self._num_failed += 1
        self._failures.append(RequestFailed(req.request_id, FinishReason.TOKEN_LIMIT, message))

    def _take_pending_drops(self, plan_id: int) -> list[int]:
        drops, self._pending_drops = self._pending_drops, []
        self._ledger.forget_after(plan_id, drops)
        return drops

    def _retire_complete_plans(self) -> None:
        # Once a dropping plan is done and processed, no message can mention its drops again.
        complete = [plan_id for plan_id, progress in self._plans.items()
                    if progress.step_done
                    and len(progress.processed_by) >= self.params.num_postproc_workers]
        for plan_id in complete:
            del self._plans[plan_id]
            self._ledger.plan_complete(plan_id)

    # ================================================================== admission

    def _admission_refusal(self, request_id: int, prompt_len: int) -> str | None:
        params = self.params
        if request_id in self._requests:
            return f"request id {request_id} is already queued or running"
        if len(self._waiting) >= params.max_queued_requests:
            return (f"queue full: {len(self._waiting)} requests waiting "
                    f"(max_queued_requests={params.max_queued_requests})")
        if self._waiting_tokens + prompt_len > params.max_queued_tokens:
            return (f"queue full: {self._waiting_tokens} prompt tokens waiting, this prompt "
                    f"adds {prompt_len} (max_queued_tokens={params.max_queued_tokens})")
        return None

    def _unrunnable(self, req: Request) -> str | None:
        params = self.params
        if req.prompt_len == 0:
            return "prompt is empty"
        if req.prompt_len >= params.max_model_len:
            return (f"prompt has {req.prompt_len} tokens; max_model_len={params.max_model_len} "
                    f"leaves no room to generate")
        if req.sampling.max_new_tokens < 1:
            return f"max_new_tokens={req.sampling.max_new_tokens} must be >= 1"
        positions = self._positions_after(req, req.prompt_len - 1)
        needed = self._blocks.blocks_for(positions)
        if needed > params.num_blocks:
            return (f"prompt needs {needed} KV blocks of {params.block_size} tokens; the whole "
                    f"cache has num_blocks={params.num_blocks}")
        return None

    # ================================================================== observation

    def _pipeline_has_room(self) -> bool:
        if self.params.async_mode:
            running = [p for p in self._plans.values() if not p.step_done]
            if len(running) >= MAX_OUTSTANDING_ASYNC:
                return False
            return not self.params.pace_plans or all(p.ending for p in running)
        # Sync mode: plan n+1 waits for StepDone(n) and every postproc worker's PlanProcessed(n).
        return not self._plans

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._pending_drops)

    def _num_outstanding(self) -> int:
        return sum(1 for progress in self._plans.values() if not progress.step_done)

    def _progress(self, plan_id: int) -> _PlanProgress | None:
        if not 0 <= plan_id < self._next_plan_id:
            raise ValueError(f"plan {plan_id} was never built (next plan id {self._next_plan_id})")
        return self._plans.get(plan_id)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_free_blocks=self._blocks.num_free,
            num_cached_blocks=self._blocks.num_cached,
            num_preemptions=self._num_preemptions,
            prefix_hit_tokens=self._prefix_hit_blocks * self.params.block_size,
            prefix_query_tokens=self._prefix_query_tokens,
            tokens_delivered=self._ledger.tokens_delivered,
            tokens_after_finish=self._ledger.tokens_after_finish,
            plans_outstanding=self._num_outstanding(),
            prefix_hit_blocks=self._prefix_hit_blocks,
            prefix_queries=self._prefix_queries,
            num_plans=self._next_plan_id,
            num_rejected=self._num_rejected,
            num_failed=self._num_failed,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError when the scheduler's bookkeeping contradicts itself."""
        self._blocks.check_invariants()
        self._check_queues()
        holders: Counter[int] = Counter()
        for req in self._running:
            self._check_running(req)
            holders.update(req.blocks)
        for block in range(self.params.num_blocks):
            assert self._blocks.refcount(block) == holders[block], (
                f"block {block}: refcount {self._blocks.refcount(block)}, "
                f"{holders[block]} holders")
            assert holders[block] <= 1 or self._blocks.is_cached(block), (
                f"block {block} is shared by {holders[block]} requests but is not a cached "
                f"prefix block")
        assert self._blocks.num_free + len(holders) == self.params.num_blocks, "blocks leaked"
        limit = MAX_OUTSTANDING_ASYNC if self.params.async_mode else 1
        assert self._num_outstanding() <= limit, f"{self._num_outstanding()} plans outstanding"

    def _check_queues(self) -> None:
        members = [req.request_id for req in self._running] + [r.request_id for r in self._waiting]
        assert len(members) == len(set(members)), "a request is queued twice"
        assert set(members) == set(self._requests), "request table and queues disagree"
        assert len(self._running) <= self.params.max_num_seqs, "too many running requests"
        assert self._waiting_tokens == sum(req.prompt_len for req in self._waiting)
        for req in self._waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not req.blocks and req.num_computed == 0, f"waiting {req.request_id} holds KV"
            assert req.known_to_worker == (req.status is RequestStatus.PREEMPTED)

    def _check_running(self, req: Request) -> None:
        rid = req.request_id
        assert req.status is RequestStatus.RUNNING and req.known_to_worker
        assert len(set(req.blocks)) == len(req.blocks), f"request {rid} holds a block twice"
        assert 0 <= req.num_computed <= req.num_tokens - 1, f"request {rid} computed too far"
        assert len(req.blocks) * self.params.block_size >= req.num_computed, (
            f"request {rid} has KV outside its blocks")
        assert req.num_tokens < req.max_tokens, f"request {rid} should have finished"
        assert req.num_registered_blocks <= len(req.blocks)
