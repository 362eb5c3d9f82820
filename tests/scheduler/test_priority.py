"""--scheduling-policy priority: the waiting queue's order, preemption of lower-priority
running requests for seats and for KV blocks, and fcfs left as it was."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.core import Scheduler
from tandem_serve.scheduler.priority import WaitingPolicy
from tests.scheduler.sched_utils import params, step_done
from tests.scheduler.simulation import Simulation, small_cache


def add(sched: Scheduler, rid: int, priority: int, prompt: int = 3, max_new: int = 40,
        at: float | None = None) -> None:
    msg = AddRequest(rid, np.arange(1, prompt + 1, dtype=np.int32),
                     SamplingParams(max_new_tokens=max_new, priority=priority),
                     float(rid) if at is None else at)
    assert sched.add_request(msg) is None


def run(sched: Scheduler, plans: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Per plan the requests it starts (new or resumed), and every preemption and finish by
    counts, in order."""
    started, preempted, dropped = [], [], []
    for _ in range(plans):
        if not sched.ready_to_plan():
            break
        plan = sched.build_plan()
        started.append([n.request_id for n in plan.new])
        preempted += plan.preempt
        dropped += plan.drop
        sched.on_step_done(step_done(plan.plan_id))
        sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
        sched.check_invariants()
    return started, preempted, dropped


def test_the_queue_is_ordered_by_priority_then_arrival() -> None:
    sched = Scheduler(params(scheduling_policy="priority"))
    for rid, prio in [(1, 5), (2, 0), (3, 5), (4, -2), (5, 0)]:
        add(sched, rid, prio)
    assert [r.request_id for r in sched.state.waiting] == [4, 2, 5, 1, 3]
    fcfs = Scheduler(params())
    for rid, prio in [(1, 5), (2, 0), (3, 5)]:
        add(fcfs, rid, prio)
    assert [r.request_id for r in fcfs.state.waiting] == [1, 2, 3]


def test_a_later_higher_priority_request_preempts_for_the_only_seat() -> None:
    sched = Scheduler(params(scheduling_policy="priority", max_num_seqs=1, num_steps=4))
    add(sched, 1, 10, max_new=12)
    add(sched, 2, 10, max_new=12)
    started, preempted, _ = run(sched, 1)
    assert started == [[1]]
    add(sched, 3, 0, max_new=8)  # later, but first in priority
    started, preempted, dropped = run(sched, 20)
    assert started[0] == [3] and preempted == [1]
    # 3 finishes first; then 1 (resumed: it arrived before 2), then 2.
    assert dropped == [3, 1, 2]
    assert sched.stats.num_preemptions == 1


def test_equal_priority_and_fcfs_never_preempt_for_a_seat() -> None:
    for policy, prio in [("priority", 10), ("fcfs", 0)]:
        sched = Scheduler(params(scheduling_policy=policy, max_num_seqs=1))
        add(sched, 1, 10 if policy == "priority" else 0, max_new=12)
        run(sched, 1)
        add(sched, 2, prio, max_new=8)
        _, preempted, dropped = run(sched, 20)
        assert preempted == [] and dropped == [1, 2]


def test_kv_pressure_preempts_the_lowest_priority_first() -> None:
    """Three requests share 6 blocks; the arrival order would make 3 the victim under fcfs,
    but 1 has the lowest priority."""
    sched = Scheduler(params(scheduling_policy="priority", num_blocks=6, num_steps=4,
                             enable_prefix_caching=False))
    add(sched, 1, 9)
    add(sched, 2, 1)
    add(sched, 3, 1)
    _, preempted, _ = run(sched, 12)
    assert preempted and preempted[0] == 1


def test_a_higher_priority_head_preempts_for_blocks_only_when_that_makes_room() -> None:
    sched = Scheduler(params(scheduling_policy="priority", num_blocks=8, num_steps=4,
                             enable_prefix_caching=False))
    add(sched, 1, 5, prompt=12, max_new=40)
    run(sched, 2)  # 1 holds most blocks now
    add(sched, 2, 0, prompt=16, max_new=4)
    started, preempted, _ = run(sched, 1)
    assert preempted == [1] and started == [[2]]
    # A head that cannot fit even in the whole cache's free blocks preempts nobody.
    sched = Scheduler(params(scheduling_policy="priority", num_blocks=8, num_steps=4))
    add(sched, 1, 5, prompt=12, max_new=40)
    run(sched, 2)
    add(sched, 2, 0, prompt=40, max_new=4)  # needs 11 blocks of 4: fails as unrunnable
    [failure] = sched.take_failures()
    assert failure.request_id == 2
    _, preempted, _ = run(sched, 1)
    assert preempted == []


def test_a_preempted_request_keeps_its_place_by_priority() -> None:
    policy = WaitingPolicy("priority")
    sched = Scheduler(params(scheduling_policy="priority", max_num_seqs=1))
    add(sched, 1, 3, max_new=12)
    run(sched, 1)
    add(sched, 2, 1, max_new=8)
    add(sched, 3, 5, max_new=8)
    add(sched, 4, 3, max_new=8)
    run(sched, 1)  # 2 preempts 1, which goes before 4 (same priority, earlier) and 3
    assert [r.request_id for r in sched.state.waiting] == [1, 4, 3]
    assert policy.by_priority
    with pytest.raises(ValueError, match="fcfs, priority"):
        WaitingPolicy("lottery")
    assert sched.state.requests[1].finish_reason is FinishReason.NOT_FINISHED


@pytest.mark.parametrize("num_steps, async_mode", [(1, False), (4, True)])
def test_random_workload_by_priority(num_steps: int, async_mode: bool) -> None:
    """The simulation's workload (stops, aborts, EOS, guided tables, adapters, a small cache)
    with four priorities: everything finishes, nothing leaks, the invariants hold."""
    sim = Simulation(small_cache(num_steps, async_mode, scheduling_policy="priority",
                                 max_loras=2), seed=31 + num_steps, adapters=3,
                     num_requests=120).run()
    assert sim.sched.stats.num_preemptions > 0
