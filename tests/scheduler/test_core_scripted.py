"""The scheduler, one scripted case at a time: admission, plans, preemption, prefix sharing.

Each test drives a Scheduler by hand with the messages the workers would send.
"""
from __future__ import annotations

import numpy as np
import pytest

from tandem_serve.proto.plan_messages import PlanEnding
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed, StopHit
from tandem_serve.scheduler.core import Scheduler
from tests.scheduler.sched_utils import add, params, step_done


def test_admission_rejects_beyond_the_queue_limits() -> None:
    sched = Scheduler(params(max_queued_requests=2, max_queued_tokens=25))
    add(sched, 1, 10)
    add(sched, 2, 10)
    msg = AddRequest(3, np.ones(3, np.int32), SamplingParams(), 0.0)
    rejected = sched.add_request(msg)
    assert rejected is not None and rejected.request_id == 3
    assert "max_queued_requests=2" in rejected.message

    sched = Scheduler(params(max_queued_tokens=25))
    add(sched, 1, 10)
    add(sched, 2, 10)
    rejected = sched.add_request(AddRequest(3, np.ones(6, np.int32), SamplingParams(), 0.0))
    assert rejected is not None and "max_queued_tokens=25" in rejected.message
    add(sched, 4, 5)  # still fits exactly
    assert sched.stats.num_rejected == 1 and sched.stats.num_waiting == 3
    sched.check_invariants()


def test_requests_that_can_never_run_fail_with_the_limit_named() -> None:
    sched = Scheduler(params(num_blocks=4, max_model_len=32))
    add(sched, 1, 32)
    add(sched, 2, 20)  # 20 positions need 5 blocks of 4
    add(sched, 3, 3, max_new=0)
    failures = {f.request_id: f for f in sched.take_failures()}
    assert "max_model_len=32" in failures[1].message
    assert "num_blocks=4" in failures[2].message
    assert "max_new_tokens" in failures[3].message
    assert not sched.ready_to_plan() and sched.take_failures() == []


def test_a_request_outgrowing_the_whole_cache_fails_and_is_dropped() -> None:
    sched = Scheduler(params(num_blocks=3, num_steps=1, max_model_len=64))
    add(sched, 1, 5, max_new=30)
    plan_ids = []
    while sched.ready_to_plan():
        plan = sched.build_plan()
        plan_ids.append(plan.plan_id)
        sched.on_step_done(step_done(plan.plan_id))
        sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
        if plan.drop:
            break
    [failure] = sched.take_failures()
    assert failure.request_id == 1 and "num_blocks=3" in failure.message
    assert plan.drop == [1] and not plan.cont
    assert sched.stats.num_free_blocks == 3
    sched.check_invariants()


def test_count_finish_is_dropped_in_the_next_plan_and_its_blocks_reused() -> None:
    sched = Scheduler(params(num_blocks=2, num_steps=4))
    add(sched, 1, 3, max_new=2)  # positions 0..3 (the last token is never computed): 1 block
    add(sched, 2, 5, max_new=1)  # positions 0..4: 2 blocks, so it waits for request 1's
    plan0 = sched.build_plan()
    assert [n.request_id for n in plan0.new] == [1]
    assert sched.stats.num_free_blocks == 2, "request 1 finishes in plan 0 by counts alone"
    plan1 = sched.build_plan()
    assert plan1.drop == [1] and [n.request_id for n in plan1.new] == [2]
    assert plan0.new[0].block_ids[0] in plan1.new[0].block_ids
    plan2 = sched.build_plan() if sched.ready_to_plan() else None
    assert plan2 is None, "two plans are outstanding"
    sched.on_step_done(step_done(0, {1: FinishReason.MAX_TOKENS}, {1: 2}))
    assert sched.build_plan().drop == [2]
    assert sched.stats.num_free_blocks == 2


def test_async_mode_keeps_one_plan_queued_and_sync_mode_waits_for_postproc() -> None:
    sched = Scheduler(params(num_postproc_workers=2))
    add(sched, 1, 4, max_new=40)
    sched.build_plan()
    sched.build_plan()
    assert not sched.ready_to_plan() and sched.stats.plans_outstanding == 2
    sched.on_step_done(step_done(0))
    assert sched.ready_to_plan()

    sched = Scheduler(params(num_postproc_workers=2, async_mode=False))
    add(sched, 1, 4, max_new=40)
    plan = sched.build_plan()
    assert not plan.publish_per_step and not sched.ready_to_plan()
    sched.on_plan_processed(PlanProcessed(0, 1))
    sched.on_step_done(step_done(0))
    assert not sched.ready_to_plan(), "worker 0 has not processed plan 0 yet"
    sched.on_plan_processed(PlanProcessed(0, 0))
    assert sched.ready_to_plan()


def test_paced_planning_builds_the_next_plan_once_the_running_one_is_ending() -> None:
    sched = Scheduler(params(pace_plans=True))
    add(sched, 1, 4, max_new=40)
    plan0 = sched.build_plan()
    add(sched, 2, 4, max_new=40)
    assert not sched.ready_to_plan(), "plan 0 has just started: later arrivals may join plan 1"
    add(sched, 3, 4, max_new=40)
    sched.on_plan_ending(PlanEnding(plan0.plan_id))
    plan1 = sched.build_plan()
    assert {n.request_id for n in plan1.new} == {2, 3}
    assert not sched.ready_to_plan() and sched.stats.plans_outstanding == 2
    sched.on_step_done(step_done(0, tokens={1: 4}))
    assert not sched.ready_to_plan(), "plan 1 is running and not ending yet"
    sched.on_plan_ending(PlanEnding(plan1.plan_id))
    assert sched.ready_to_plan()
    sched.on_plan_ending(PlanEnding(0))  # a plan already done: nothing changes
    assert sched.ready_to_plan()
    with pytest.raises(ValueError, match="plan 7 was never built"):
        sched.on_plan_ending(PlanEnding(7))
    sched.build_plan()
    sched.on_step_done(step_done(1, tokens={1: 4, 2: 4, 3: 4}))
    sched.on_step_done(step_done(2, tokens={1: 4, 2: 4, 3: 4}))
    assert sched.ready_to_plan(), "nothing running: plan at once"

    sync = Scheduler(params(pace_plans=True, async_mode=False, num_postproc_workers=1))
    add(sync, 1, 4, max_new=40)
    sync.build_plan()
    sync.on_step_done(step_done(0, tokens={1: 4}))
    sync.on_plan_processed(PlanProcessed(0, 0))
    assert sync.ready_to_plan(), "sync mode never waits for PlanEnding"


def test_a_late_finish_is_dropped_in_the_next_built_plan() -> None:
    sched = Scheduler(params())
    add(sched, 1, 4, max_new=40)
    add(sched, 2, 4, max_new=40)
    sched.build_plan()
    plan1 = sched.build_plan()
    assert plan1.drop == []
    free_before = sched.stats.num_free_blocks
    sched.on_step_done(step_done(0, {1: FinishReason.EOS_TOKEN}, {1: 3, 2: 4}))
    assert sched.stats.num_free_blocks > free_before, "blocks come back at once"
    plan2 = sched.build_plan()
    assert plan2.drop == [1]
    assert all(c.request_id != 1 for c in plan2.cont)
    sched.on_step_done(step_done(1, {1: FinishReason.EOS_TOKEN}))  # reported again: ignored
    sched.check_invariants()


def test_prefix_blocks_are_shared_only_from_a_later_plan() -> None:
    sched = Scheduler(params(num_steps=1))
    prompt = list(range(100, 112))  # three full blocks
    add(sched, 1, prompt)
    add(sched, 2, [*prompt, 7, 7])
    plan0 = sched.build_plan()
    assert [n.num_cached_tokens for n in plan0.new] == [0, 0], "same plan: no sharing"
    add(sched, 3, [*prompt, 9])
    add(sched, 4, prompt)
    plan1 = sched.build_plan()
    cached = {n.request_id: n.num_cached_tokens for n in plan1.new}
    assert cached == {3: 12, 4: 8}, "at most len - 1 tokens come from the cache"
    new3 = next(n for n in plan1.new if n.request_id == 3)
    new1 = next(n for n in plan0.new if n.request_id == 1)
    assert new3.block_ids[:3] == new1.block_ids[:3]
    assert new3.num_prefill_tokens == 0, "only the last token is left: it is decoded"
    stats = sched.stats
    assert stats.prefix_hit_tokens == 20 and stats.prefix_hit_blocks == 5
    assert stats.prefix_query_tokens == 12 + 14 + 13 + 12
    sched.check_invariants()


def test_preemption_takes_the_newest_and_resumes_it_first() -> None:
    sched = Scheduler(params(num_blocks=6, num_steps=4, max_model_len=64,
                             enable_prefix_caching=False))
    add(sched, 1, 3, max_new=40)
    add(sched, 2, 3, max_new=40)
    add(sched, 3, 3, max_new=40)
    preempted: list[int] = []
    resumed: list[int] = []
    for plan_id in range(12):
        plan = sched.build_plan()
        preempted += plan.preempt
        resumed += [n.request_id for n in plan.new if n.resume]
        for new in plan.new:
            if new.resume:
                assert new.sampling is None and len(new.prompt_ids) == 0
                assert new.num_prefill_tokens > 0
        sched.on_step_done(step_done(plan_id))
        sched.on_plan_processed(PlanProcessed(plan_id, 0))
        sched.check_invariants()
    assert preempted and preempted[0] == 3, "the newest request goes first"
    assert sched.stats.num_preemptions == len(preempted)


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = Scheduler(params(max_num_batched_tokens=8, num_steps=1))
    add(sched, 1, 20)
    add(sched, 2, 3)
    chunks = []
    for plan_id in range(4):
        plan = sched.build_plan()
        total = sum(n.num_prefill_tokens for n in plan.new)
        total += sum(c.num_prefill_tokens for c in plan.cont)
        chunks.append(total)
        sched.on_step_done(step_done(plan_id))
        sched.on_plan_processed(PlanProcessed(plan_id, 0))
    assert all(c <= 8 for c in chunks)
    assert chunks[0] == 8 and sum(chunks[:3]) >= 19


def test_stop_hit_and_abort_count_tokens_made_after_the_finish() -> None:
    sched = Scheduler(params())
    add(sched, 1, 4, max_new=40)
    add(sched, 2, 4, max_new=40)
    sched.build_plan()
    sched.build_plan()
    sched.on_stop_hit(StopHit(1, 2))  # before the tokens it cuts were even reported
    sched.on_step_done(step_done(0, tokens={1: 4, 2: 4}))
    sched.abort_request(2)
    sched.abort_request(2)  # twice, and an unknown id: both ignored
    sched.abort_request(99)
    sched.on_step_done(step_done(1, tokens={1: 4, 2: 4}))
    stats = sched.stats
    assert stats.tokens_delivered == 2 + 4
    assert stats.tokens_after_finish == 2 + 4 + 4
    plan = sched.build_plan()
    assert sorted(plan.drop) == [1, 2]


def test_a_prefill_chunk_shrinks_to_the_blocks_left() -> None:
    sched = Scheduler(params(num_blocks=4, num_steps=1, max_num_batched_tokens=8,
                             enable_prefix_caching=False))
    add(sched, 1, 2, max_new=40)
    add(sched, 2, 13)  # completing needs all 4 blocks; only 3 can be had in plan 1
    sched.build_plan()
    sched.on_step_done(step_done(0))
    sched.on_plan_processed(PlanProcessed(0, 0))
    plan1 = sched.build_plan()
    [cont] = [c for c in plan1.cont if c.request_id == 2]
    assert cont.num_prefill_tokens == 5 and len(cont.new_block_ids) == 1
    sched.check_invariants()


def test_nobody_overtakes_the_head_of_the_queue() -> None:
    sched = Scheduler(params(num_blocks=4, num_steps=4, enable_prefix_caching=False))
    add(sched, 1, 9, max_new=40)  # 8 + 4 positions: 3 blocks
    add(sched, 2, 9)  # 3 blocks: has to wait
    add(sched, 3, 2)  # 1 block would fit, but request 2 came first
    plan = sched.build_plan()
    assert [n.request_id for n in plan.new] == [1]
    assert sched.stats.num_waiting == 2


def test_prompt_logprobs_requests_never_take_cached_prefix_blocks() -> None:
    sched = Scheduler(params(num_steps=1))
    prompt = list(range(100, 112))  # three full blocks
    add(sched, 1, prompt)
    sched.build_plan()  # request 1's prompt blocks are registered from here on
    scored = AddRequest(2, np.array([*prompt, 9], dtype=np.int32),
                        SamplingParams(max_new_tokens=8, prompt_logprobs=True), 0.0)
    assert sched.add_request(scored) is None
    add(sched, 3, [*prompt, 9])
    plan = sched.build_plan()
    new = {n.request_id: n for n in plan.new}
    assert new[2].num_cached_tokens == 0, "every prompt position must be computed to score it"
    assert new[2].num_prefill_tokens == len(prompt)
    assert new[3].num_cached_tokens == 12, "the same prompt without prompt logprobs hits"
    sched.check_invariants()
