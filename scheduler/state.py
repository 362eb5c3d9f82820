"""The scheduler's bookkeeping: what it knows, the changes that keep that consistent, and
the checks that it is.

`SchedulerState` holds the request table and queues, the block manager, the adapter slots,
the constraints, the token ledger, the outstanding plans and the counters.
`scheduler/core.py`'s `Scheduler` owns one and makes the decisions (admission, planning,
preemption) over it: it reads the state's collections and parts as it likes, and changes
the table, the queues, the plans and the counters only through the state's methods, which
keep them consistent with each other.  Apart, each reads in one sitting, and the
invariants sit next to the state they check.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem_serve.proto.request_messages import RequestFailed, RequestRejected
from tandem_serve.proto.request_params import FinishReason, GuidedKind
from tandem_serve.scheduler.guided import WorkerConstraints
from tandem_serve.scheduler.kv.block_manager import BlockManager
from tandem_serve.scheduler.kv.host_tier import KvTier
from tandem_serve.scheduler.lora_slots import LoraSlots
from tandem_serve.scheduler.priority import WaitingPolicy
from tandem_serve.scheduler.requests import Request, RequestStatus, TokenLedger

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
    # Tokens per step of a plan: decoding rows first, prefill chunk pieces in the rest
    # (`scheduler/budget.py`); with `prefill_phase` (the baseline) per plan instead.
    max_num_batched_tokens: int = 2048
    prefill_phase: bool = False
    # Context at which a prefill token's attention costs what the rest of its forward does
    # (from the gpu worker; 0: count plain tokens): later pieces of a prompt count for more.
    attention_tokens: int = 0
    async_mode: bool = True
    num_postproc_workers: int = 2
    enable_prefix_caching: bool = True
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    # Async mode: build plan n+1 only once plan n is ending (PlanEnding) or done, not as soon
    # as plan n is sent, so that requests arriving during plan n still make plan n+1.
    pace_plans: bool = False
    # Guided decoding: the model's vocabulary (a table's token_class must cover it; 0: not
    # checked) and how many constraints no running request uses the worker keeps for reuse.
    vocab_size: int = 0
    guided_kept: int = 32
    max_loras: int = 0  # the gpu worker's LoRA adapter slots (0: adapters off)
    # Speculative decoding's draft tokens per step (0: off; `scheduler.speculation`).
    num_speculative_tokens: int = 0
    scheduling_policy: str = "fcfs"  # or "priority" (`scheduler.priority`)
    # The host KV tier's blocks (0: off; `scheduler/kv/host_tier.py`), and whether the prefix
    # cache's changes are recorded for vLLM's KV events (`scheduler/kv/events.py`).
    num_host_blocks: int = 0
    record_kv_events: bool = False
    # A prefix hit covers a multiple of this many blocks (a hybrid model's recurrent states
    # are checkpointed only there: `WorkerReady.state_checkpoint_blocks`).
    prefix_granularity: int = 1


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
    loaded_adapters: tuple[str, ...] = ()  # resident in the worker's slots, slot order
    adapter_loads: int = 0
    running_adapters: tuple[str, ...] = ()  # of running requests, in order of first appearance
    waiting_adapters: tuple[str, ...] = ()  # of waiting (and preempted) requests, likewise
    external_query_tokens: int = 0  # the host tier's (vLLM's external_prefix_cache_*)
    external_hit_tokens: int = 0
    host_blocks_used: int = 0


@dataclass
class PlanProgress:
    step_done: bool = False
    ending: bool = False  # the worker is running its last steps (PlanEnding)
    processed_by: set[int] = field(default_factory=set)


class SchedulerState:
    """The scheduler's state and its consistent changes; `Scheduler` makes the decisions."""

    def __init__(self, params: SchedulerParams) -> None:
        if params.num_steps < 1 or params.max_num_batched_tokens < 1 or params.max_num_seqs < 1:
            raise ValueError(f"num_steps, max_num_batched_tokens and max_num_seqs must be >= 1: "
                             f"{params}")
        self.params = params
        self.blocks = BlockManager(params.num_blocks, params.block_size,
                                   params.enable_prefix_caching)
        self.tier = KvTier(params.num_blocks, params.block_size,
                           params.num_host_blocks if params.enable_prefix_caching else 0,
                           params.record_kv_events and params.enable_prefix_caching)
        if self.tier.active:
            self.blocks.observer = self.tier
        self.lora = LoraSlots(params.max_loras)
        self.constraints = WorkerConstraints(params.guided_kept, params.vocab_size)
        self.ledger = TokenLedger()
        self.requests: dict[int, Request] = {}  # waiting, preempted and running
        # fcfs: preempted ones at the front; priority: by (priority, arrival)
        self.waiting: deque[Request] = deque()
        self.policy = WaitingPolicy(params.scheduling_policy)
        self.running: list[Request] = []  # oldest admission first; preempted newest first
        self._waiting_tokens = 0
        self._pending_drops: list[int] = []
        self._plans: dict[int, PlanProgress] = {}  # built and not yet done and processed
        self._next_plan_id = 0
        self._failures: list[RequestFailed] = []
        self._num_preemptions = 0
        self._num_rejected = 0
        self._num_failed = 0
        self._prefix_queries = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_blocks = 0
        # Arrival (the frontend's clock: one monotonic clock per host) to first scheduling.
        self._queue_times: list[float] = []
        self._queue_ids: list[int] = []  # whose they are, in the same order

    # ================================================================== state changes

    def queue_refusal(self, request_id: int, prompt_len: int) -> str | None:
        """Why a new request may not join the queue now (a duplicate id, or the queue's
        limits), or None."""
        params = self.params
        if request_id in self.requests:
            return f"request id {request_id} is already queued or running"
        if len(self.waiting) >= params.max_queued_requests:
            return (f"queue full: {len(self.waiting)} requests waiting "
                    f"(max_queued_requests={params.max_queued_requests})")
        if self.waiting_tokens + prompt_len > params.max_queued_tokens:
            return (f"queue full: {self.waiting_tokens} prompt tokens waiting, this prompt "
                    f"adds {prompt_len} (max_queued_tokens={params.max_queued_tokens})")
        return None

    def queue(self, req: Request) -> None:
        """A new request joins the back of the waiting queue (by priority: its place)."""
        self.requests[req.request_id] = req
        self.policy.enqueue(self.waiting, req)
        self._waiting_tokens += req.prompt_len

    def reject(self, request_id: int, why: str) -> RequestRejected:
        self._num_rejected += 1
        return RequestRejected(request_id, why)

    def start_running(self, req: Request, num_cached: int, num_hit_blocks: int,
                      now: float, num_host_blocks: int = 0) -> None:
        """The head of the waiting queue runs, its first `num_cached` tokens from the cache
        (`num_hit_blocks` of them the device's, `num_host_blocks` the host tier's, which
        are registered once the plan is built); `now` on the frontend's clock, for its queue
        time when it runs for the first time."""
        if not req.known_to_worker:
            self._queue_times.append(max(0.0, now - req.arrival_time))
            self._queue_ids.append(req.request_id)
        self.waiting.popleft()
        self._waiting_tokens -= req.prompt_len
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed = num_cached
        req.num_registered_blocks = num_hit_blocks
        self.ledger.open(req.request_id)
        if _guided(req):
            self.constraints.start(req.sampling.guided_id)
        if self.params.enable_prefix_caching:
            self._prefix_queries += 1
            self._prefix_query_tokens += req.num_tokens
            self._prefix_hit_blocks += num_hit_blocks
            self.tier.count_query(req.num_tokens, num_host_blocks)

    def preempt(self, req: Request) -> None:
        """Recompute, not swap: the worker frees the KV and keeps the token history, and the
        request waits at the front of the queue (by priority: its place)."""
        self.running.remove(req)
        self.blocks.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        if _guided(req):  # the worker replays it on resume
            self.constraints.stop(req.sampling.guided_id)
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.policy.requeue(self.waiting, req)
        self._waiting_tokens += req.prompt_len

    def order_running(self) -> None:
        """By the waiting policy's order (priority: highest first), so that preemption under
        KV pressure, which takes the running list's last requests, takes the lowest."""
        self.policy.order_running(self.running)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if _guided(req):
            if req.status is RequestStatus.RUNNING:
                self.constraints.stop(req.sampling.guided_id)
            self.constraints.release(req.sampling.guided_id)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
            self._waiting_tokens -= req.prompt_len
        self.blocks.free(req.blocks)
        req.blocks = []
        if req.lora_slot:
            self.lora.give_back(req.adapter_id)
            req.lora_slot = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        if req.known_to_worker:
            self._pending_drops.append(req.request_id)

    def fail(self, req: Request, message: str) -> None:
        self.ledger.cut(req.request_id)
        self.finish(req, FinishReason.TOKEN_LIMIT)
        self.record_failure(req, message)

    def record_failure(self, req: Request, message: str,
                       reason: FinishReason = FinishReason.TOKEN_LIMIT) -> None:
        self._num_failed += 1
        self._failures.append(RequestFailed(req.request_id, reason, message))

    def fail_as_error(self, request_id: int, message: str, code: str) -> None:
        """End `request_id` as an error with gRPC status `code`, whether it is still here or
        finished by counts in the meantime (the frontend still waits for it)."""
        req = self.requests.get(request_id)
        self.ledger.cut(request_id)
        if req is not None:
            self.finish(req, FinishReason.ERROR)
            self._num_failed += 1
        self._failures.append(RequestFailed(request_id, FinishReason.ERROR, message, code))

    def fail_guided(self, gid: str, message: str, code: str = "") -> None:
        """Every request that names constraint `gid` and is not running fails as an error:
        its table arrived malformed or cannot be had (running ones have it at the worker)."""
        for req in [r for r in self.requests.values() if r.sampling.guided_id == gid
                    and _guided(r) and r.status is not RequestStatus.RUNNING]:
            self.fail_as_error(req.request_id, message, code)

    def take_failures(self) -> list[RequestFailed]:
        failures, self._failures = self._failures, []
        return failures

    def take_queue_times(self) -> list[float]:
        times, self._queue_times = self._queue_times, []
        return times

    def take_queue_ids(self) -> list[int]:
        ids, self._queue_ids = self._queue_ids, []
        return ids

    def take_pending_drops(self, plan_id: int) -> list[int]:
        drops, self._pending_drops = self._pending_drops, []
        self.ledger.forget_after(plan_id, drops)
        return drops

    @property
    def next_plan_id(self) -> int:
        return self._next_plan_id

    def open_plan(self) -> None:
        """Plan `next_plan_id` is sent: outstanding until it is done and processed."""
        self._plans[self._next_plan_id] = PlanProgress()
        self._next_plan_id += 1

    def retire_complete_plans(self) -> None:
        # Once a dropping plan is done and processed, no message can mention its drops again.
        complete = [plan_id for plan_id, progress in self._plans.items()
                    if progress.step_done
                    and len(progress.processed_by) >= self.params.num_postproc_workers]
        for plan_id in complete:
            del self._plans[plan_id]
            self.ledger.plan_complete(plan_id)

    # ================================================================== observation

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the waiting queue (admission control's token limit)."""
        return self._waiting_tokens

    def pipeline_has_room(self) -> bool:
        if self.params.async_mode:
            running = [p for p in self._plans.values() if not p.step_done]
            if len(running) >= MAX_OUTSTANDING_ASYNC:
                return False
            return not self.params.pace_plans or all(p.ending for p in running)
        # Sync mode: plan n+1 waits for StepDone(n) and every postproc worker's PlanProcessed(n).
        return not self._plans

    def has_work(self) -> bool:
        # A head of the queue waiting for its constraint's table waits for a message, not a
        # plan: planning only for it would send the worker empty plans until it comes.
        startable = bool(self.waiting) and self.constraints.ready(self.waiting[0].sampling)
        return bool(startable or self.running or self._pending_drops)

    def has_running_work(self) -> bool:
        """Work for a plan without admitting anyone: running requests, or drops to send."""
        return bool(self.running or self._pending_drops)

    def num_outstanding(self) -> int:
        return sum(1 for progress in self._plans.values() if not progress.step_done)

    def progress(self, plan_id: int) -> PlanProgress | None:
        """An outstanding plan's progress; None once retired, ValueError if never built."""
        if not 0 <= plan_id < self._next_plan_id:
            raise ValueError(f"plan {plan_id} was never built (next plan id {self._next_plan_id})")
        return self._plans.get(plan_id)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_free_blocks=self.blocks.num_free,
            num_cached_blocks=self.blocks.num_cached,
            num_preemptions=self._num_preemptions,
            prefix_hit_tokens=self._prefix_hit_blocks * self.params.block_size,
            prefix_query_tokens=self._prefix_query_tokens,
            tokens_delivered=self.ledger.tokens_delivered,
            tokens_after_finish=self.ledger.tokens_after_finish,
            plans_outstanding=self.num_outstanding(),
            prefix_hit_blocks=self._prefix_hit_blocks,
            prefix_queries=self._prefix_queries,
            num_plans=self._next_plan_id,
            num_rejected=self._num_rejected,
            num_failed=self._num_failed,
            loaded_adapters=tuple(self.lora.resident),
            adapter_loads=self.lora.num_loads,
            running_adapters=adapters_of(self.running) if self.params.max_loras else (),
            waiting_adapters=adapters_of(self.waiting) if self.params.max_loras else (),
            external_query_tokens=self.tier.query_tokens,
            external_hit_tokens=self.tier.hit_tokens,
            host_blocks_used=self.tier.num_used,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError when the scheduler's bookkeeping contradicts itself."""
        self.blocks.check_invariants()
        self.tier.check_invariants()
        self._check_queues()
        holders: Counter[int] = Counter()
        for req in self.running:
            self._check_running(req)
            holders.update(req.blocks)
        for block in range(self.params.num_blocks):
            assert self.blocks.refcount(block) == holders[block], (
                f"block {block}: refcount {self.blocks.refcount(block)}, "
                f"{holders[block]} holders")
            assert holders[block] <= 1 or self.blocks.is_cached(block), (
                f"block {block} is shared by {holders[block]} requests but is not a cached "
                f"prefix block")
        assert self.blocks.num_free + len(holders) == self.params.num_blocks, "blocks leaked"
        self.constraints.check_invariants(
            Counter(r.sampling.guided_id for r in self.running if _guided(r)),
            Counter(r.sampling.guided_id for r in self.requests.values() if _guided(r)))
        self._check_adapters()
        limit = MAX_OUTSTANDING_ASYNC if self.params.async_mode else 1
        assert self.num_outstanding() <= limit, f"{self.num_outstanding()} plans outstanding"

    def _check_queues(self) -> None:
        members = [req.request_id for req in self.running] + [r.request_id for r in self.waiting]
        assert len(members) == len(set(members)), "a request is queued twice"
        assert set(members) == set(self.requests), "request table and queues disagree"
        assert len(self.running) <= self.params.max_num_seqs, "too many running requests"
        assert self._waiting_tokens == sum(req.prompt_len for req in self.waiting)
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not req.blocks and req.num_computed == 0, f"waiting {req.request_id} holds KV"
            assert req.known_to_worker == (req.status is RequestStatus.PREEMPTED)

    def _check_adapters(self) -> None:
        holders: Counter[str] = Counter()
        for req in self.requests.values():
            if req.lora_slot:
                assert req.lora_slot == self.lora.slot_of(req.adapter_id), (
                    f"request {req.request_id} holds slot {req.lora_slot}, its adapter "
                    f"{req.adapter_id!r} is in slot {self.lora.slot_of(req.adapter_id)}")
                holders[req.adapter_id] += 1
            else:
                assert not (req.adapter_id and req.known_to_worker), (
                    f"request {req.request_id} reached the worker without its adapter slot")
        self.lora.check_invariants(holders)

    def _check_running(self, req: Request) -> None:
        rid = req.request_id
        assert req.status is RequestStatus.RUNNING and req.known_to_worker
        assert len(set(req.blocks)) == len(req.blocks), f"request {rid} holds a block twice"
        assert 0 <= req.num_computed <= req.num_tokens - 1, f"request {rid} computed too far"
        assert len(req.blocks) * self.params.block_size >= req.num_computed, (
            f"request {rid} has KV outside its blocks")
        assert req.num_tokens < req.max_tokens, f"request {rid} should have finished"
        assert req.num_registered_blocks <= len(req.blocks)


def _guided(req: Request) -> bool:
    return req.sampling.guided_kind != GuidedKind.NONE


def adapters_of(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.adapter_id for r in requests if r.adapter_id))
