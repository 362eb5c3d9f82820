"""LoRA adapter slots in the scheduler: assignment, LRU eviction, waiting, prefix-cache salt,
preemption, failed loads."""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.adapter_messages import AdapterFailed, AdapterLoad
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.core import Scheduler
from tandem_serve.scheduler.lora_slots import LoraSlots
from tests.scheduler.sched_utils import params, step_done


def add(sched: Scheduler, rid: int, adapter: str, prompt: int | list[int] = 6,
        max_new: int = 8) -> None:
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    msg = AddRequest(rid, np.array(ids, dtype=np.int32), SamplingParams(max_new_tokens=max_new),
                     0.0, adapter_id=adapter)
    assert sched.add_request(msg) is None


def finish(sched: Scheduler, plan_id: int, rid: int) -> None:
    sched.on_step_done(step_done(plan_id, {rid: FinishReason.EOS_TOKEN}))
    sched.on_plan_processed(PlanProcessed(plan_id, 0))


def test_slots_lowest_free_first_then_least_recently_used_idle() -> None:
    slots = LoraSlots(2)
    assert slots.take("a") == (1, AdapterLoad(1, "a"))
    assert slots.take("b") == (2, AdapterLoad(2, "b"))
    assert slots.take("a") == (1, None)  # resident: no load
    assert not slots.can_take("c")  # both held
    slots.give_back("b")
    slots.give_back("a")
    assert slots.can_take("c") and slots.resident == ["a", "b"]
    slots.give_back("a")  # now a was used last: b is the least recently used idle one
    assert slots.take("c") == (2, AdapterLoad(2, "c"))
    assert slots.resident == ["a", "c"] and slots.num_loads == 3


def test_a_request_waits_at_the_head_while_every_slot_is_held() -> None:
    sched = Scheduler(params(max_loras=1))
    add(sched, 1, "x")
    add(sched, 2, "y")  # needs the only slot
    add(sched, 3, "")  # no adapter, but first come first served: behind request 2
    plan0 = sched.build_plan()
    assert [n.request_id for n in plan0.new] == [1]
    assert plan0.adapters == [AdapterLoad(1, "x")] and plan0.new[0].lora_slot == 1
    assert sched.stats.num_waiting == 2
    sched.check_invariants()
    finish(sched, plan0.plan_id, 1)
    plan1 = sched.build_plan()
    assert plan1.drop == [1]
    assert [(n.request_id, n.lora_slot) for n in plan1.new] == [(2, 1), (3, 0)]
    assert plan1.adapters == [AdapterLoad(1, "y")]  # x was idle: evicted
    assert sched.stats.loaded_adapters == ("y",) and sched.stats.adapter_loads == 2
    sched.check_invariants()


def test_stats_name_the_adapters_of_running_and_waiting_requests() -> None:
    sched = Scheduler(params(max_loras=1))
    for rid, adapter in enumerate(["x", "y", "", "y", "x"], 1):
        add(sched, rid, adapter)
    sched.build_plan()  # request 1 runs with x's slot; 2 waits for it, and 3-5 behind it
    s = sched.stats
    assert (s.running_adapters, s.waiting_adapters) == (("x",), ("y", "x"))
    assert Scheduler(params()).stats.running_adapters == ()  # adapters off


def test_prefix_cache_never_shares_kv_across_adapters() -> None:
    sched = Scheduler(params(num_steps=1, max_loras=2))
    prompt = list(range(1, 14))  # three full blocks of 4
    add(sched, 1, "x", prompt, max_new=1)
    add(sched, 2, "", prompt, max_new=1)
    add(sched, 3, "x", prompt, max_new=1)
    plan0 = sched.build_plan()
    assert all(n.num_cached_tokens == 0 for n in plan0.new)  # nothing registered yet
    sched.on_step_done(step_done(plan0.plan_id))
    sched.on_plan_processed(PlanProcessed(plan0.plan_id, 0))
    add(sched, 4, "", prompt, max_new=1)
    add(sched, 5, "x", prompt, max_new=1)
    add(sched, 6, "y", prompt, max_new=1)
    plan1 = sched.build_plan()
    cached = {n.request_id: n.num_cached_tokens for n in plan1.new}
    assert cached == {4: 12, 5: 12, 6: 0}
    sched.check_invariants()


def test_a_preempted_request_keeps_its_slot_and_resumes_without_a_load() -> None:
    sched = Scheduler(params(num_blocks=6, num_steps=4, max_loras=1))
    add(sched, 1, "x", 6, max_new=20)
    add(sched, 2, "x", 6, max_new=20)
    plans = [sched.build_plan()]
    assert plans[0].adapters == [AdapterLoad(1, "x")]
    while not any(p.preempt for p in plans):
        sched.on_step_done(step_done(plans[-1].plan_id))
        sched.on_plan_processed(PlanProcessed(plans[-1].plan_id, 0))
        plans.append(sched.build_plan())
        sched.check_invariants()
    [victim] = plans[-1].preempt
    add(sched, 3, "z")  # behind the preempted request; its slot is held
    assert sched.state.lora.slot_of("x") == 1 and not sched.state.lora.can_take("z")
    for _ in range(40):
        sched.on_step_done(step_done(plans[-1].plan_id))
        sched.on_plan_processed(PlanProcessed(plans[-1].plan_id, 0))
        if not sched.ready_to_plan():
            break
        plans.append(sched.build_plan())
        sched.check_invariants()
        resumed = [n for n in plans[-1].new if n.request_id == victim]
        if resumed:
            assert resumed[0].resume and not plans[-1].adapters
            break
    else:
        raise AssertionError("the preempted request never resumed")


def test_a_failed_load_fails_every_holder_and_frees_the_slot() -> None:
    sched = Scheduler(params(max_loras=2))
    add(sched, 1, "bad", max_new=4)  # finished by counts in plan 0, before the news comes
    add(sched, 2, "good")
    add(sched, 5, "bad", max_new=20)
    plan0 = sched.build_plan()
    add(sched, 3, "bad")  # admitted in the next plan, before the failure is known
    plan1 = sched.build_plan()  # async: built while plan 0 runs
    assert [n.request_id for n in plan1.new] == [3] and not plan1.adapters
    assert plan1.drop == [1]
    sched.on_adapter_failed(AdapterFailed(plan0.plan_id, "bad", 1, "adapter 'bad': broken",
                                          [1, 5]))
    failures = {f.request_id: f for f in sched.take_failures()}
    assert set(failures) == {1, 3, 5}
    assert all(f.code == "INVALID_ARGUMENT" and f.reason == FinishReason.ERROR
               and "broken" in f.message for f in failures.values())
    assert sched.stats.loaded_adapters == ("good",)
    sched.check_invariants()
    add(sched, 4, "bad")  # retried: the file may have been fixed
    for plan in (plan0, plan1):
        sched.on_step_done(step_done(plan.plan_id))
        sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
    plan2 = sched.build_plan()
    assert {3, 5} <= set(plan2.drop) and plan2.adapters == [AdapterLoad(1, "bad")]


def test_adapter_ids_fail_when_adapters_are_off() -> None:
    sched = Scheduler(params())
    add(sched, 1, "x")
    [failure] = sched.take_failures()
    assert "not enabled" in failure.message
