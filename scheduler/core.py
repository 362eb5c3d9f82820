"""The scheduler's pure logic: admission, KV block accounting, plans, preemption.

No sockets, no processes: `scheduler/main.py` calls one method per message it receives and,
while `ready_to_plan()`, sends `build_plan()` to the gpu worker.

The scheduler predicts every request's state at the worker from counts alone (see
`scheduler/requests.py`).  Plans run in order at the worker and apply their drops and
preemptions before any forward, so blocks freed while building plan n (or when a late finish
arrives) may go to other requests in plan n: whatever earlier plans still write into them
happens before.

The `Scheduler` owns its state (`scheduler/state.py`'s `SchedulerState`: request table,
queues, blocks, outstanding plans, counters, with the changes that keep them consistent,
statistics and invariant checks) and decides; it changes the state only through the
state's methods.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tandem_serve.proto.adapter_messages import AdapterFailed, AdapterLoad
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedLost, GuidedTable
from tandem_serve.proto.plan_messages import (
    ContinueRequest,
    NewRequest,
    PlanEnding,
    StepDone,
    StepPlan,
)
from tandem_serve.proto.request_messages import AddRequest, RequestFailed, RequestRejected
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import PlanProcessed, StopHit
from tandem_serve.scheduler.budget import DecodeSteps, Split, StepBudget
from tandem_serve.scheduler.control import ControlGate
from tandem_serve.scheduler.guided import constraint_id
from tandem_serve.scheduler.kv.block_manager import adapter_salt, prompt_block_hashes
from tandem_serve.scheduler.kv.events import record_stored
from tandem_serve.scheduler.kv.host_tier import KvEvent
from tandem_serve.scheduler.requests import Request, RequestStatus
from tandem_serve.scheduler.speculation import SpecCounts
from tandem_serve.scheduler.state import (
    MAX_OUTSTANDING_ASYNC,
    SchedulerParams,
    SchedulerState,
    SchedulerStats,
)

__all__ = ["MAX_OUTSTANDING_ASYNC", "Scheduler", "SchedulerParams", "SchedulerStats"]


@dataclass
class _Draft:
    """The plan being built."""

    plan_id: int
    budget: StepBudget  # tokens left per step under max_num_batched_tokens
    new: list[NewRequest] = field(default_factory=list)
    cont: list[ContinueRequest] = field(default_factory=list)
    preempt: list[int] = field(default_factory=list)
    chunks: dict[int, tuple[Request, Split]] = field(default_factory=dict)  # id -> its work
    loads: list[AdapterLoad] = field(default_factory=list)  # adapters new to the worker
    yielded: int = 0  # of `preempt`, those preempted for a higher priority (not for blocks)

    def schedule(self, req: Request, split: Split) -> None:
        self.chunks[req.request_id] = (req, split)
        self.budget.take(split)

    def has(self, req: Request) -> bool:
        return req.request_id in self.chunks


class Scheduler:
    """Admission, planning and preemption over the bookkeeping of the `SchedulerState` it
    owns (`state`)."""

    def __init__(self, params: SchedulerParams) -> None:
        self.state = SchedulerState(params)
        self.params = params
        self.spec = SpecCounts(params.num_speculative_tokens,
                               params.num_blocks * params.block_size)
        self.clock = time.monotonic  # tests replace it
        self.gate = ControlGate()  # the rollout controls' holds (scheduler/control.py)

    @property
    def stats(self) -> SchedulerStats:
        return self.state.stats

    def check_invariants(self) -> None:
        """Raise AssertionError when the scheduler's bookkeeping contradicts itself."""
        self.state.check_invariants()

    # ================================================================== messages in

    def add_request(self, msg: AddRequest) -> RequestRejected | None:
        """Queue a request; a RequestRejected (limit named) when admission control says no.

        A request that can never run (empty prompt, prompt >= max_model_len, max_new_tokens < 1,
        more KV than the whole cache) is not rejected but failed: see `take_failures`.
        """
        prompt_ids = np.ascontiguousarray(msg.prompt_ids, dtype=np.int32)
        rejection = self.state.queue_refusal(msg.request_id, len(prompt_ids))
        if rejection is not None:
            return self.state.reject(msg.request_id, rejection)
        req = Request(msg.request_id, prompt_ids, msg.sampling, msg.arrival_time,
                      self.params.max_model_len, adapter_id=msg.adapter_id,
                      images=list(msg.images))
        problem = self._unrunnable(req)
        if problem is not None:
            self.state.record_failure(req, problem)
            return None
        problem = self.state.constraints.problem(msg)
        if problem is not None:  # the frontend's compiler made it: a bug, not an overload
            self.state.record_failure(req, problem, FinishReason.ERROR)
            return None
        self.state.constraints.hold(msg)
        if self.params.enable_prefix_caching:  # KV computed under an adapter is its own
            req.prompt_block_hashes = prompt_block_hashes(prompt_ids, self.params.block_size,
                                                          adapter_salt(req.adapter_id),
                                                          req.images)
        self.state.queue(req)
        return None

    def abort_request(self, request_id: int,
                      reason: FinishReason = FinishReason.CANCELLED) -> None:
        req = self.state.requests.get(request_id)
        self.state.ledger.cut(request_id)
        if req is not None:
            self.state.finish(req, reason)

    def on_step_done(self, msg: StepDone) -> None:
        progress = self.state.progress(msg.plan_id)
        if progress is None:  # a duplicate of a plan already retired
            return
        progress.step_done = True
        produced = dict(zip(msg.request_ids.tolist(), msg.num_tokens.tolist(), strict=True))
        reached = self.spec.correct(msg.plan_id, produced, self.state.requests)
        for request_id, num_tokens in produced.items():
            self.state.ledger.add_produced(request_id, num_tokens)
        finished = zip(msg.finished_ids.tolist(), msg.finish_reasons.tolist(), strict=True)
        for request_id, reason in finished:
            req = self.state.requests.get(request_id)
            if req is not None:  # else finished by counts, aborted, or reported again
                self.state.finish(req, FinishReason(reason))
        for req in reached:  # speculation: a finish by counts inside a plan already built
            if req.status is RequestStatus.RUNNING and (reason := req.count_finish()):
                self.state.finish(req, reason)
        self.state.retire_complete_plans()

    def on_adapter_failed(self, msg: AdapterFailed) -> None:
        """The worker could not load an adapter: the requests it names never ran, and every
        request holding that slot for the adapter is doomed too (the worker fails them as it
        meets them).  Each fails with INVALID_ARGUMENT, even one finished here by counts in
        the meantime (the frontend still waits for it); the slot is freed, so a later
        request retries the load."""
        doomed = dict.fromkeys(msg.request_ids)
        if self.state.lora.slot_of(msg.adapter_id) == msg.slot:
            doomed.update(dict.fromkeys(req.request_id for req in self.state.requests.values()
                                        if req.lora_slot and req.adapter_id == msg.adapter_id))
        for rid in doomed:
            self.state.fail_as_error(rid, msg.message, "INVALID_ARGUMENT")
        self.state.lora.forget(msg.adapter_id, msg.slot)

    def on_constraint(self, item: GuidedTable | GuidedGrammar) -> None:
        """A constraint's table, sent on its own (once per id, and again when asked); a
        malformed one fails the requests that name it."""
        problem = self.state.constraints.receive(item)
        if problem is not None:
            self.state.fail_guided(constraint_id(item), problem)

    def on_constraint_lost(self, msg: GuidedLost) -> None:
        if self.state.constraints.lost(msg.guided_id):
            self.state.fail_guided(msg.guided_id, msg.message, "UNAVAILABLE")

    def take_wanted_constraints(self) -> list[str]:
        """Constraints to ask the frontend for (`GuidedWanted`)."""
        return self.state.constraints.take_wanted()

    def on_plan_ending(self, msg: PlanEnding) -> None:
        progress = self.state.progress(msg.plan_id)
        if progress is not None:
            progress.ending = True

    def on_stop_hit(self, msg: StopHit) -> None:
        self.state.ledger.cut(msg.request_id, msg.num_tokens)
        req = self.state.requests.get(msg.request_id)
        if req is not None:
            self.state.finish(req, FinishReason.STOP_SEQUENCE)

    def on_plan_processed(self, msg: PlanProcessed) -> None:
        if not 0 <= msg.worker_index < self.params.num_postproc_workers:
            raise ValueError(f"PlanProcessed from postproc worker {msg.worker_index}; there are "
                             f"{self.params.num_postproc_workers}")
        progress = self.state.progress(msg.plan_id)
        if progress is not None:
            progress.processed_by.add(msg.worker_index)
            self.state.retire_complete_plans()

    def take_queue_times(self) -> list[float]:
        """Seconds from arrival to first scheduling of each request first scheduled since the
        previous call (a resumed request counts once, at its first start)."""
        return self.state.take_queue_times()

    def take_queue_ids(self) -> list[int]:
        """The request ids of `take_queue_times`'s answer, in its order (call both)."""
        return self.state.take_queue_ids()

    def take_failures(self) -> list[RequestFailed]:
        return self.state.take_failures()

    # ================================================================== planning

    def ready_to_plan(self) -> bool:
        if self.gate.paused:
            return False
        if self.gate.holds_admission():  # only what runs already (and drops) make a plan
            return self.state.pipeline_has_room() and self.state.has_running_work()
        return self.state.pipeline_has_room() and self.state.has_work()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block (the one place the prefix index is cleared);
        how many blocks had a hash."""
        return self.state.blocks.clear()

    def build_plan(self) -> StepPlan:
        """Running requests first (decodes, then prefill chunks), then the waiting queue."""
        if not self.ready_to_plan():
            raise RuntimeError("build_plan() called while ready_to_plan() is False")
        params = self.params
        draft = _Draft(self.state.next_plan_id, StepBudget(
            params.num_steps, params.max_num_batched_tokens, params.prefill_phase,
            0 if params.prefill_phase else params.attention_tokens))
        self._yield_to_priority(draft)
        self._continue_decodes(draft)
        if not draft.chunks:
            draft.budget.prefill_only()
        self._continue_prefills(draft)
        # Blocks ran short for running requests (other than to yield to a higher priority), or a
        # control holds admission: admit nobody.
        if len(draft.preempt) == draft.yielded and not self.gate.holds_admission():
            self._admit_waiting(draft)
        drop = self.state.take_pending_drops(draft.plan_id)
        # Before _advance: requests that finish by counts inside this plan still need theirs.
        tables, drop_tables = self.state.constraints.take()
        self._advance(draft)
        plan = self._issue(draft, drop)
        plan.tables, plan.drop_tables = tables, drop_tables
        copies = self.state.tier.take_copies()  # the host tier's, run before the forwards
        plan.offload_blocks, plan.offload_slots = copies.offload_blocks, copies.offload_slots
        plan.onload_slots, plan.onload_blocks = copies.onload_slots, copies.onload_blocks
        return plan

    def _yield_to_priority(self, draft: _Draft) -> None:
        """--scheduling-policy priority: lower-priority running requests make room for a
        higher-priority head of the queue (`scheduler/priority.py`)."""
        state = self.state
        state.order_running()
        for req in state.policy.victims(state.waiting, state.running, self.params.max_num_seqs,
                                        self._fits_after):
            self._preempt(req, draft)
            draft.yielded += 1

    def _fits_after(self, head: Request, victims: list[Request]) -> bool:
        """Whether `head` would find blocks for its first plan once `victims` are freed."""
        needed = self.state.blocks.blocks_for(head.num_tokens - 1 + self._steps(head))
        return needed <= self.state.blocks.num_free + sum(len(v.blocks) for v in victims)
    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's changes since the last call (vLLM's KV events)."""
        return self.state.tier.take_events()

    def _continue_decodes(self, draft: _Draft) -> None:
        for req in list(self.state.running):
            if req.status is RequestStatus.RUNNING and not req.is_prefilling:
                self._continue_decode(req, draft)

    def _continue_decode(self, req: Request, draft: _Draft) -> None:
        # The worker decodes every running request K times (capped by its limits) whether
        # the plan names it or not: it gets its lookahead blocks, or leaves the batch now.
        steps = self._steps(req)
        positions = self.spec.positions(req, req.num_computed, steps)
        if not self._fits_alone(req, positions):
            return
        new_blocks = self._grow(req, positions, draft)
        if new_blocks is None:
            self._preempt(req, draft)
            return
        draft.schedule(req, Split([], 0, steps))
        if new_blocks:
            draft.cont.append(ContinueRequest(req.request_id, new_blocks))

    def _continue_prefills(self, draft: _Draft) -> None:
        for req in list(self.state.running):
            if not draft.budget.has_room():
                return
            if req.status is RequestStatus.RUNNING and req.is_prefilling and not draft.has(req):
                self._continue_prefill(req, draft)

    def _continue_prefill(self, req: Request, draft: _Draft) -> None:
        split = draft.budget.split(req.prefill_left, self._decode_steps(req),
                                   context=req.num_computed, whole=req.whole_spans)
        while split is not None:
            new_blocks = self._grow(req, self._positions_after(req, req.num_computed, split),
                                    draft)
            if new_blocks is not None:
                draft.schedule(req, split)
                draft.cont.append(ContinueRequest(req.request_id, new_blocks, split.total,
                                                  split.message_steps()))
                return
            smaller = self._chunk_that_fits(req, split.total)
            split = None if smaller is None else draft.budget.split(
                req.prefill_left, self._decode_steps(req), smaller, req.num_computed,
                req.whole_spans)

    def _admit_waiting(self, draft: _Draft) -> None:
        while (self.state.waiting and draft.budget.has_room()
               and len(self.state.running) < self.params.max_num_seqs):
            if not self._admit(self.state.waiting[0], draft):
                return  # first come, first served: nobody overtakes the head of the queue

    def _admit(self, req: Request, draft: _Draft) -> bool:
        """Start (or resume) the head of the queue; False when it has to wait."""
        if not self._fits_alone(req, req.num_tokens - 1 + self._steps(req)):
            return True
        if not self.spec.confirmed(req):
            return False  # preempted while a plan ran: its history length is not known yet
        if not req.lora_slot and not self.state.lora.can_take(req.adapter_id):
            return False  # every adapter slot is held: wait like for KV blocks
        if not self.state.constraints.ready(req.sampling):
            return False  # its constraint's table is on its way from the frontend
        # Prompt logprobs need every prompt position computed: no cached prefix for those.
        hashes = [] if req.sampling.prompt_logprobs else self._cacheable_hashes(req)
        hits = self.state.blocks.lookup(hashes)
        # A hybrid model's hits end where its recurrent state was checkpointed (the host
        # tier is refused for those models, so its run follows whole device hits only).
        hits = hits[:len(hits) - len(hits) % self.params.prefix_granularity]
        host = self.state.tier.lookup(hashes[len(hits):])  # then the host tier's run
        cut = req.cached_blocks(len(hits) + len(host), self.params.block_size)
        hits, host = hits[:cut], host[:max(0, cut - len(hits))]  # never inside an image
        num_cached = (len(hits) + len(host)) * self.params.block_size
        split = draft.budget.split(req.num_tokens - 1 - num_cached, self._decode_steps(req),
                                   context=num_cached, whole=req.whole_spans)
        if split is None:
            return False
        positions = self._positions_after(req, num_cached, split)
        num_new = self.state.blocks.blocks_for(positions) - len(hits)
        if num_new > self.state.blocks.num_free - self.state.blocks.num_evictable(hits):
            return False
        self.state.blocks.take(hits)
        self.state.tier.pin(host)  # before allocating: evictions offload into other slots
        new_blocks = self.state.blocks.allocate(num_new)
        self.state.tier.onload(host, new_blocks[:len(host)])
        req.blocks = hits + new_blocks
        if req.adapter_id and not req.lora_slot:  # a preempted request kept its slot
            req.lora_slot, load = self.state.lora.take(req.adapter_id)
            if load is not None:
                draft.loads.append(load)
        self.state.start_running(req, num_cached, len(hits), self.clock(), len(host))
        draft.schedule(req, split)
        draft.new.append(self._new_request_message(req, num_cached, split))
        req.known_to_worker = True
        return True

    def _advance(self, draft: _Draft) -> None:
        """Predict the worker's counts after this plan; register filled prompt blocks."""
        for req, split in draft.chunks.values():
            req.num_computed += split.total
            if not req.is_prefilling:
                steps = split.decode_steps
                req.num_tokens += steps
                req.num_computed += steps
                self.spec.predict(draft.plan_id, req, steps)
            self._register_filled_blocks(req)
            finish = req.count_finish()
            if finish is not None:  # the worker stops it in this plan: drop it in the next
                self.state.finish(req, finish)

    def _issue(self, draft: _Draft, drop: list[int]) -> StepPlan:
        self.state.open_plan()
        return StepPlan(
            plan_id=draft.plan_id,
            num_steps=self.params.num_steps,
            new=draft.new,
            cont=draft.cont,
            drop=drop,
            preempt=draft.preempt,
            publish_per_step=self.params.async_mode,
            adapters=draft.loads,
            prefill_phase=self.params.prefill_phase,
        )

    # ================================================================== planning helpers

    def _steps(self, req: Request, first: int = 0) -> int:
        """Decode steps the worker runs for `req` in one plan from step `first`: it stops
        at its limits."""
        return min(self.params.num_steps - first, req.steps_left)

    def _decode_steps(self, req: Request) -> DecodeSteps:
        return lambda first: self._steps(req, first)

    def _positions_after(self, req: Request, num_computed: int, split: Split) -> int:
        """KV positions `req` needs once `split`'s chunk is computed after `num_computed`:
        a chunk that completes the prompt decodes in the same plan, so its decode lookahead
        is included."""
        return self.spec.positions(req, num_computed + split.total,
                                   split.decode_steps if split.join is not None else 0)

    def _chunk_that_fits(self, req: Request, num_prefill: int) -> int | None:
        """A smaller chunk that does not complete the prompt and fits in the free blocks."""
        room = (len(req.blocks) + self.state.blocks.num_free) * self.params.block_size
        smaller = min(num_prefill, req.prefill_left - 1, room - req.num_computed)
        return smaller if 0 < smaller < num_prefill else None

    def _grow(self, req: Request, positions: int, draft: _Draft) -> list[int] | None:
        """Blocks for `positions`, preempting newer unscheduled requests; None if that fails."""
        num_new = max(0, self.state.blocks.blocks_for(positions) - len(req.blocks))
        while num_new > self.state.blocks.num_free:
            victim = self._newest_unscheduled(draft)
            if victim is req:
                return None
            self._preempt(victim, draft)
        new_blocks = self.state.blocks.allocate(num_new)
        req.blocks.extend(new_blocks)
        return new_blocks

    def _newest_unscheduled(self, draft: _Draft) -> Request:
        # Callers are themselves running and unscheduled, so there always is one.
        return next(req for req in reversed(self.state.running) if not draft.has(req))

    def _fits_alone(self, req: Request, positions: int) -> bool:
        """False (and the request failed) when even the whole cache is too small for it."""
        needed = self.state.blocks.blocks_for(positions)
        if needed <= self.params.num_blocks:
            return True
        self.state.fail(req, f"request {req.request_id} needs {needed} KV blocks of "
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
        stored = [index for index in range(req.num_registered_blocks, filled)
                  if self.state.blocks.register(req.blocks[index],
                                                req.prompt_block_hashes[index])]
        req.num_registered_blocks = max(req.num_registered_blocks, filled)
        if stored and self.state.tier.record_events:
            record_stored(self.state.tier, req, stored)

    def _new_request_message(self, req: Request, num_cached: int, split: Split) -> NewRequest:
        if req.known_to_worker:  # resuming: the worker kept the history and sampling params
            return NewRequest(req.request_id, np.empty(0, dtype=np.int32), None,
                              list(req.blocks), num_cached, split.total, resume=True,
                              prefill_steps=split.message_steps())
        # The worker keeps a request's images until it is dropped: they go out once.
        images, req.images = req.images, []
        return NewRequest(req.request_id, req.prompt_ids, req.sampling, list(req.blocks),
                          num_cached, split.total, lora_slot=req.lora_slot,
                          prefill_steps=split.message_steps(), images=images)

    # ================================================================== preemption

    def _preempt(self, req: Request, draft: _Draft) -> None:
        self.state.preempt(req)
        draft.preempt.append(req.request_id)

    # ================================================================== admission

    def _unrunnable(self, req: Request) -> str | None:
        params = self.params
        if req.prompt_len == 0:
            return "prompt is empty"
        if req.prompt_len >= params.max_model_len:
            return (f"prompt has {req.prompt_len} tokens; max_model_len={params.max_model_len} "
                    f"leaves no room to generate")
        if req.sampling.max_new_tokens < 1:
            return f"max_new_tokens={req.sampling.max_new_tokens} must be >= 1"
        if req.adapter_id and params.max_loras < 1:
            return f"adapter {req.adapter_id!r}: LoRA adapters are not enabled (max_loras=0)"
        positions = req.prompt_len - 1 + self._steps(req)
        needed = self.state.blocks.blocks_for(positions)
        if needed > params.num_blocks:
            return (f"prompt needs {needed} KV blocks of {params.block_size} tokens; the whole "
                    f"cache has num_blocks={params.num_blocks}")
        return None
