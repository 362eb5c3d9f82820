"""Queue time: arrival to first scheduling, once per request, resumes not counted again."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.core import Scheduler
from tests.scheduler.sched_utils import params, step_done


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def add(sched: Scheduler, rid: int, arrival: float, max_new: int = 8) -> None:
    msg = AddRequest(rid, np.arange(1, 4, dtype=np.int32), SamplingParams(max_new_tokens=max_new),
                     arrival)
    assert sched.add_request(msg) is None


def test_queue_time_is_taken_once_when_a_request_is_first_scheduled() -> None:
    sched = Scheduler(params(max_num_seqs=1))
    sched.clock = clock = Clock()
    add(sched, 1, arrival=99.5, max_new=4)
    add(sched, 2, arrival=99.75, max_new=4)
    assert sched.take_queue_times() == []
    sched.build_plan()  # only request 1 fits (one running request at most)
    assert sched.take_queue_times() == [pytest.approx(0.5)]
    assert sched.take_queue_ids() == [1]  # whose (request traces' time in queue)
    assert sched.take_queue_times() == [] and sched.take_queue_ids() == []  # taken
    clock.now = 101.0
    sched.on_step_done(step_done(0))  # 4 steps: request 1 is done by count
    sched.on_plan_processed(PlanProcessed(0, 0))
    sched.build_plan()
    assert sched.take_queue_times() == [pytest.approx(1.25)]
    assert sched.take_queue_ids() == [2]


def test_a_resumed_request_is_not_counted_again() -> None:
    sched = Scheduler(params(num_blocks=6, num_steps=4, max_model_len=64,
                             enable_prefix_caching=False))
    sched.clock = Clock()
    for rid in (1, 2, 3):
        add(sched, rid, arrival=100.0, max_new=40)
    times: list[float] = []
    resumed = 0
    for plan_id in range(12):
        plan = sched.build_plan()
        resumed += sum(n.resume for n in plan.new)
        times += sched.take_queue_times()
        sched.on_step_done(step_done(plan_id))
        sched.on_plan_processed(PlanProcessed(plan_id, 0))
    assert resumed > 0, "the cache is small enough to preempt"
    assert len(times) == 3 and all(t == 0.0 for t in times)
