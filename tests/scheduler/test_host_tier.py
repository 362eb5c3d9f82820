"""The host KV tier's bookkeeping and the recorded KV events, through the scheduler and the
fake gpu worker (which holds host slots and checks every KV it reads, `fake_workers.py`)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tandem_serve.proto.plan_messages import StepPlan
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.core import Scheduler
from tandem_serve.scheduler.kv.block_manager import prompt_block_hashes
from tandem_serve.scheduler.kv.host_tier import CPU, GPU, Cleared, Removed, Stored
from tests.scheduler.fake_workers import FakeWorker
from tests.scheduler.sched_utils import params
from tests.scheduler.simulation import Simulation, small_cache


def serve(sched: Scheduler, worker: FakeWorker, prompts: dict[int, list[int]],
          max_new: int = 4) -> list[StepPlan]:
    """Run `prompts` to their end, plan by plan (sync: one plan at a time)."""
    for rid, prompt in prompts.items():
        msg = AddRequest(rid, np.array(prompt, dtype=np.int32),
                         SamplingParams(max_new_tokens=max_new), 0.0)
        assert sched.add_request(msg) is None
    plans = []
    while sched.ready_to_plan():
        plan = sched.build_plan()
        plans.append(plan)
        done, _ = worker.run(plan)
        sched.on_step_done(done)
        sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
        sched.check_invariants()
    return plans


def tier_setup(num_blocks: int = 12, num_host_blocks: int = 40, events: bool = True
               ) -> tuple[Scheduler, FakeWorker]:
    p = params(num_blocks=num_blocks, block_size=4, max_model_len=64, async_mode=False,
               num_host_blocks=num_host_blocks, record_kv_events=events)
    return Scheduler(p), FakeWorker(p, random.Random(0), 0.0)


def test_a_resent_prompt_comes_back_from_the_host_tier() -> None:
    sched, worker = tier_setup()
    rng = random.Random(1)
    long = [rng.randrange(1, 50) for _ in range(36)]  # 9 full blocks of 12
    serve(sched, worker, {1: long})
    serve(sched, worker, {2: [rng.randrange(1, 50) for _ in range(40)]})  # evicts it all
    assert worker.copied[0] >= 8, "the evicted prompt blocks went to the host"
    before = sched.stats.external_hit_tokens, sched.stats.prefix_hit_tokens
    plans = serve(sched, worker, {3: long})
    hit = sched.stats.external_hit_tokens - before[0]
    device = sched.stats.prefix_hit_tokens - before[1]
    # Every full block but the last (its last token is decoded): the head still on the
    # device (evicted last: a tail goes first), the rest from the host.
    assert device + hit == 8 * 4 and hit >= 6 * 4
    first = plans[0]
    assert len(first.onload_slots) == hit // 4 and first.new[0].num_cached_tokens == 32
    assert first.new[0].block_ids[device // 4 : 8] == first.onload_blocks
    # The fake worker checked the KV it read; the prompt's blocks are the device's again.
    assert sched.state.blocks.lookup(prompt_block_hashes(np.array(long), 4)[:8])
    stats = sched.stats
    assert stats.external_query_tokens >= 3 * 36 and stats.host_blocks_used > 0


def test_the_events_tell_the_story() -> None:
    sched, worker = tier_setup()
    rng = random.Random(2)
    first = [rng.randrange(1, 50) for _ in range(17)]
    hashes = prompt_block_hashes(np.array(first), 4)
    serve(sched, worker, {1: first})
    events = sched.take_kv_events()
    stored = [e for e in events if isinstance(e, Stored)]
    assert [e.medium for e in stored] == [GPU] * len(stored)
    assert [h for e in stored for h in e.hashes] == hashes
    assert [t for e in stored for t in e.token_ids] == first[:16]
    for e in stored:  # each run's parent is the hash of the block before it
        i = hashes.index(e.hashes[0])
        assert e.parent == (hashes[i - 1] if i else None)
    serve(sched, worker, {2: first})  # the same prompt: nothing new is stored
    assert not [e for e in sched.take_kv_events() if isinstance(e, Stored)]
    serve(sched, worker, {3: [rng.randrange(1, 50) for _ in range(44)]})
    events = sched.take_kv_events()
    removed = [h for e in events if isinstance(e, Removed) and e.medium == GPU
               for h in e.hashes]
    assert set(hashes) <= set(removed)
    on_host = [e for e in events if isinstance(e, Stored) and e.medium == CPU]
    assert {h for e in on_host for h in e.hashes} >= set(hashes)
    for e in on_host:  # the host's copy carries the block's own tokens and parent
        i = hashes.index(e.hashes[0]) if e.hashes[0] in hashes else None
        if i is not None:
            assert e.token_ids == first[4 * i : 4 * i + 4]
            assert e.parent == (hashes[i - 1] if i else None)
    sched.state.blocks.clear()
    assert sched.take_kv_events() == [Cleared()]
    assert sched.stats.host_blocks_used == 0 and not sched.state.blocks.num_cached
    sched.check_invariants()


def test_a_full_host_tier_drops_its_oldest_blocks() -> None:
    sched, worker = tier_setup(num_blocks=10, num_host_blocks=4)
    rng = random.Random(3)
    for rid in range(1, 6):
        serve(sched, worker, {rid: [rng.randrange(1, 50) for _ in range(24)]})
    events = sched.take_kv_events()
    assert any(isinstance(e, Removed) and e.medium == CPU for e in events)
    assert sched.stats.host_blocks_used == 4


def test_without_events_nothing_is_recorded() -> None:
    sched, worker = tier_setup(events=False)
    serve(sched, worker, {1: list(range(1, 30)), 2: list(range(2, 40))})
    assert sched.take_kv_events() == []


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_host_blocks", [3, 64])
def test_random_workload_with_a_host_tier(async_mode: bool, num_host_blocks: int) -> None:
    # Preemption, shared prefixes, aborts and stop strings with the tier: every KV the fake
    # worker reads (host hits included) is checked against the tokens before it.
    p = small_cache(4, async_mode, num_host_blocks=num_host_blocks, record_kv_events=True)
    sim = Simulation(p, seed=num_host_blocks + async_mode).run()
    stats = sim.sched.stats
    assert sim.worker.copied[0] > 0 and sim.worker.copied[1] > 0
    assert stats.external_hit_tokens > 0 and stats.num_preemptions > 0


def test_random_workload_with_a_host_tier_and_adapters() -> None:
    p = small_cache(4, True, num_host_blocks=32, max_loras=2, record_kv_events=True)
    sim = Simulation(p, seed=9, adapters=3, p_guided=0.0).run()
    assert sim.worker.copied[1] > 0
    stored = [e for e in sim.sched.take_kv_events() if isinstance(e, Stored)]
    # KV computed under an adapter is its own (its hash chain starts from the adapter's
    # salt), and its events say which adapter, on both media.
    assert {e.adapter_id for e in stored if e.medium == GPU} >= {"", "lora-0", "lora-1"}
    assert {e.adapter_id for e in stored if e.medium == CPU} - {""}
