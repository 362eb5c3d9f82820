"""The gpu worker's side of the request state: the mirror of the scheduler's
`scheduler/state.py`, changed only by each plan's deltas (`StepPlan`: drop, preempt, new,
cont, adapter loads, constraint tables), kept on the host across plans.

What a plan starts with is decided here; what its steps do on the device is the step
executor's (`gpu_worker.executor`).
"""
from __future__ import annotations

import logging

from tandem_serve.adapters.peft import AdapterError
from tandem_serve.gpu_worker.constrain.tables import GuidedRegistry
from tandem_serve.gpu_worker.lora import LoraWeights
from tandem_serve.gpu_worker.models.hybrid.state_cache import SlotPool
from tandem_serve.gpu_worker.sampling import prompt_logprobs
from tandem_serve.gpu_worker.spec.proposer import Proposer
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.adapter_messages import AdapterFailed
from tandem_serve.proto.plan_messages import NewRequest, StepPlan
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import PromptDetail

log = logging.getLogger(__name__)


class RequestTable:
    """The requests the scheduler has sent and not dropped, by id."""

    def __init__(self, guided: GuidedRegistry, lora: LoraWeights | None,
                 proposer: Proposer | None = None, slots: SlotPool | None = None) -> None:
        self.requests: dict[int, RequestState] = {}
        self.guided = guided  # constraint tables (device) and grammars (host matchers)
        self.lora = lora  # adapter slots; None: adapters off, every row is the base
        self.proposer = proposer  # speculation's drafts (None: off); it may hold KV too
        self.slots = slots  # hybrid models' recurrent-state slots (None: no such model)
        self._details: list[PromptDetail] = []  # prompt detail waiting to be published
        self._adapter_failures: list[AdapterFailed] = []

    def apply(self, plan: StepPlan) -> None:
        for rid in plan.drop:
            gone = self.requests.pop(rid, None)
            if gone is not None and self.slots is not None:
                self.slots.give(gone.state_slot)
        for rid in plan.preempt:
            req = self.requests.get(rid)
            if req is not None:
                if self.slots is not None:  # resumed by recompute from position 0
                    self.slots.give(req.state_slot)
                    req.state_slot = -1
                req.block_ids, req.num_computed, req.prefill_chunk = [], 0, 0
                req.prefill_steps = []
                self.guided.pause(req)
                if self.proposer is not None:
                    self.proposer.preempted(req)
        # Requests dropped first: a table no request uses any more may go in the same plan.
        self.guided.apply(plan.tables, plan.drop_tables)
        self._load_adapters(plan)  # into slots no remaining request uses
        for new in plan.new:
            self._add(new)
        self._fail_unloaded(plan)
        for cont in plan.cont:
            req = self.requests.get(cont.request_id)
            if req is not None:
                req.block_ids.extend(cont.new_block_ids)
                req.prefill_chunk = cont.num_prefill_tokens
                req.prefill_steps = list(cont.prefill_steps)

    def named_finished(self, plan: StepPlan) -> list[RequestState]:
        """The requests the plan names that had finished before its steps (reported again:
        the scheduler ignores repeats)."""
        named = [n.request_id for n in plan.new] + [c.request_id for c in plan.cont]
        return [r for rid in named if (r := self.requests.get(rid)) and r.finished]

    def take_details(self) -> list[PromptDetail]:
        """Prompt detail to publish before any token of its request."""
        details, self._details = self._details, []
        return details

    def take_adapter_failures(self) -> list[AdapterFailed]:
        failures, self._adapter_failures = self._adapter_failures, []
        return failures

    def _add(self, new: NewRequest) -> None:
        req = self.requests.get(new.request_id)
        if new.resume and req is not None:
            req.block_ids = list(new.block_ids)
        else:
            assert new.sampling is not None, "a new request carries its sampling params"
            prompt = [int(t) for t in new.prompt_ids]
            req = RequestState(new.request_id, prompt, len(prompt), new.sampling,
                               list(new.block_ids), lora_slot=new.lora_slot,
                               images=list(new.images))
            self.requests[new.request_id] = req
            if new.sampling.prompt_logprobs and len(prompt) == 1:
                self._details.append(prompt_logprobs.empty_detail(req))
        req.num_computed = new.num_cached_tokens
        if self.slots is not None:
            # A cached prefix's state is restored into the slot by the runner.
            if req.state_slot < 0:
                req.state_slot = self.slots.take()
        req.prefill_chunk = new.num_prefill_tokens
        req.prefill_steps = list(new.prefill_steps)
        self.guided.start(req)  # fresh: the initial state; resumed: its output replayed

    def _load_adapters(self, plan: StepPlan) -> None:
        for load in plan.adapters:
            if self.lora is None:
                continue  # the requests using it fail in _fail_unloaded
            try:
                self.lora.load(load.slot, load.adapter_id)
            except AdapterError as exc:
                log.warning("plan %d: %s", plan.plan_id, exc)

    def _fail_unloaded(self, plan: StepPlan) -> None:
        """Requests whose adapter slot holds no adapter (its load failed) never run: they
        finish with ERROR and the scheduler hears why (AdapterFailed, before StepDone)."""
        by_slot: dict[int, list[int]] = {}
        for new in plan.new:
            req = self.requests.get(new.request_id)
            if req is None or req.finished or not req.lora_slot:
                continue
            if self.lora is not None and req.lora_slot not in self.lora.failed:
                continue
            req.finished = FinishReason.ERROR
            by_slot.setdefault(req.lora_slot, []).append(req.request_id)
        for slot, rids in by_slot.items():
            error = self.lora.failed.get(slot) if self.lora is not None else None
            message = str(error) if error else (
                "LoRA adapters are not enabled on the gpu worker (--adapter-cache)")
            adapter_id = error.adapter_id if error else ""
            self._adapter_failures.append(
                AdapterFailed(plan.plan_id, adapter_id, slot, message, rids))
            self._details = [d for d in self._details if d.request_id not in rids]
