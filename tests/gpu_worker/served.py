"""A real `Scheduler` planning for a real `ModelRunner` in one process, no sockets.

The scheduler's plans (per-step prefill pieces, preemption, prefix hits) go straight to
`execute`, its StepDone straight back, and a `TokenPublisher` collects every TokenBatch and
PromptDetail.  In async mode one plan is kept queued ahead, built before the running plan's
finishes are known, as the scheduler process does; postprocessing is instant.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem_serve.gpu_worker.publisher import TokenPublisher
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.steps import attention_tokens
from tandem_serve.proto.plan_messages import StepDone, StepPlan
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed, PromptDetail, TokenBatch
from tandem_serve.scheduler.core import Scheduler, SchedulerParams


@dataclass
class Served:
    """Arrivals (by plan count), the plans built, and what each request got."""

    runner: ModelRunner
    num_steps: int = 8
    async_mode: bool = True
    budget: int = 32
    prefill_phase: bool = False
    params: dict[str, Any] = field(default_factory=dict)  # more SchedulerParams

    def __post_init__(self) -> None:
        r = self.runner
        params: dict[str, Any] = dict(  # what the scheduler process makes of WorkerReady
            attention_tokens=attention_tokens(r.model.config), **self.params)
        self.sched = Scheduler(SchedulerParams(
            num_blocks=r.num_blocks, block_size=r.block_size, num_steps=self.num_steps,
            max_model_len=r.max_model_len, max_num_batched_tokens=self.budget,
            async_mode=self.async_mode, num_postproc_workers=1,
            prefill_phase=self.prefill_phase, **params))
        self.messages: list[TokenBatch | PromptDetail] = []
        self.publisher = TokenPublisher(self.messages.append, r.device)
        self.arrivals: dict[int, list[AddRequest]] = {}
        self.plans: list[StepPlan] = []
        self.done: list[StepDone] = []

    def add(self, rid: int, prompt: list[int], sampling: SamplingParams,
            after_plans: int = 0, **extra: Any) -> None:
        """Request `rid` arrives once `after_plans` plans have run (`extra`: more of its
        AddRequest: its guided constraint, its adapter)."""
        msg = AddRequest(rid, np.array(prompt, dtype=np.int32), sampling, 0.0, **extra)
        self.arrivals.setdefault(after_plans, []).append(msg)

    def run(self, max_plans: int = 500) -> dict[int, list[int]]:
        queued: deque[StepPlan] = deque()
        ran = 0
        while self.arrivals or queued or self.sched.ready_to_plan():
            for msg in self.arrivals.pop(ran, []):
                assert self.sched.add_request(msg) is None
            while self.sched.ready_to_plan():
                queued.append(self.sched.build_plan())
                self.sched.check_invariants()
            if not queued:
                ran += 1  # idle until the next arrival
                continue
            plan = queued.popleft()
            self.plans.append(plan)
            done = self.runner.execute(plan, self.publisher)
            self.done.append(done)
            self.sched.on_step_done(done)
            self.sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
            ran += 1
            assert ran < max_plans
        assert not self.sched.take_failures()
        return self.outputs()

    def outputs(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for m in self.messages:
            if isinstance(m, TokenBatch):
                for rid, tok in zip(m.request_ids.tolist(), m.token_ids.tolist(), strict=True):
                    if tok >= 0:
                        out.setdefault(rid, []).append(tok)
        return out

    def details(self, rid: int) -> list[PromptDetail]:
        return [m for m in self.messages if isinstance(m, PromptDetail) and m.request_id == rid]

    def spread(self) -> list[list[int]]:
        """Every multi-step piece list the plans sent (chunks spread over steps)."""
        return [x.prefill_steps for p in self.plans for x in (*p.new, *p.cont)
                if len(x.prefill_steps) > 1]

    def close(self) -> None:
        self.publisher.close()
