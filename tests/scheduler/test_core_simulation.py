"""The scheduler under random workloads, driven by a scripted fake gpu worker and fake
postproc workers (`simulation.py`): every run must end with every request finished, no block
leaked and every token accounted for.
"""
from __future__ import annotations

from collections import Counter

import pytest

from tests.scheduler.simulation import Simulation, small_cache


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_random_workload_small_cache(num_steps: int, async_mode: bool) -> None:
    sim = Simulation(small_cache(num_steps, async_mode), seed=num_steps * 10 + async_mode).run()
    stats = sim.sched.stats
    assert stats.num_preemptions > 0, "the small cache should force preemptions"
    assert stats.prefix_hit_tokens > 0 and stats.prefix_hit_blocks > 0
    assert stats.prefix_query_tokens >= stats.prefix_hit_tokens
    if async_mode or num_steps > 1:  # sync K=1 learns every stop before the next step
        assert stats.tokens_after_finish > 0, "late stop strings waste some tokens"
    assert stats.num_failed > 0, "prompts at max_model_len fail"
    hows = Counter(sim.ended.values())
    assert hows["stop"] and hows["worker"] and hows["abort"]


@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_random_workload_paced_planning(num_steps: int) -> None:
    params = small_cache(num_steps, True, pace_plans=True)
    stats = Simulation(params, seed=num_steps * 7 + 1).run().sched.stats
    assert stats.num_preemptions > 0 and stats.num_failed > 0


def test_random_workload_without_prefix_caching() -> None:
    params = small_cache(4, True, enable_prefix_caching=False)
    stats = Simulation(params, seed=5).run().sched.stats
    assert stats.prefix_hit_tokens == stats.prefix_query_tokens == stats.num_cached_blocks == 0


def test_random_workload_roomy_cache_one_postproc() -> None:
    params = small_cache(4, True, num_blocks=400, max_num_seqs=32, num_postproc_workers=1,
                         max_num_batched_tokens=64)
    stats = Simulation(params, seed=11).run().sched.stats
    assert stats.num_preemptions == 0
    assert stats.prefix_hit_tokens > 0


def test_random_workload_cache_smaller_than_one_request() -> None:
    # 28 cache slots against max_model_len 48: long requests fail at admission or mid-way.
    params = small_cache(4, True, num_blocks=7, max_num_batched_tokens=10)
    stats = Simulation(params, seed=2, num_requests=60).run().sched.stats
    assert stats.num_failed > 0 and stats.num_preemptions > 0


def test_random_workload_tight_budget() -> None:
    # A token budget barely above the batch size: prefills crawl along in tiny chunks.
    params = small_cache(2, False, max_num_seqs=4, max_num_batched_tokens=5, num_blocks=40)
    Simulation(params, seed=3, num_requests=60).run()


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_random_workload_with_more_adapters_than_slots(async_mode: bool) -> None:
    # The fake worker checks every request runs with its own adapter in its slot, that no
    # load replaces an adapter a request holds, and (salted KV) no prefix is shared across
    # adapters.
    params = small_cache(4, async_mode, max_loras=2, num_blocks=60)
    sim = Simulation(params, seed=21 + async_mode, adapters=5, num_requests=120).run()
    stats = sim.sched.stats
    assert stats.adapter_loads > 5, "5 adapters through 2 slots: evictions and reloads"
    assert stats.prefix_hit_tokens > 0
    assert len(stats.loaded_adapters) == 2


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_steps", [1, 4])
def test_random_workload_with_constraints_named_by_id(num_steps: int, async_mode: bool) -> None:
    # Tables travel on their own and are asked for again, answered late: the fake worker
    # still finds every constraint a plan runs with, sent once while held.
    sim = Simulation(small_cache(num_steps, async_mode), seed=31 + num_steps + async_mode,
                     ids_only=True).run()
    assert sim.num_asked > 0, "some tables were asked for again"
    assert sim.sched.stats.num_preemptions > 0


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_steps", [1, 4])
def test_random_workload_speculative(num_steps: int, async_mode: bool) -> None:
    # A step advances a row by 1 to 1 + k tokens: the scheduler plans on lower bounds, its
    # lookahead covers the upper one (the fake worker checks every write and block), and
    # StepDone's counts correct it; preempted requests resume with exact histories.
    # K * (k + 1) lookahead: a larger cache, or nothing but one request fits.
    params = small_cache(num_steps, async_mode, num_speculative_tokens=3 if num_steps == 1 else 2,
                         num_blocks=24 if num_steps == 1 else 40)
    sim = Simulation(params, seed=41 + num_steps + async_mode).run()
    stats = sim.sched.stats
    assert stats.num_preemptions > 0
    hows = Counter(sim.ended.values())
    assert hows["stop"] and hows["worker"] and hows["abort"]
