"""The rollout controls in the scheduler: pause holds every plan, model operations wait for
the running requests and go out behind the plans, and one reset clears the prefix cache."""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.control_messages import ControlDone, EngineControl
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.scheduler.control import ControlHandler
from tandem_serve.scheduler.core import Scheduler
from tandem_serve.scheduler.kv.block_manager import BlockManager, prompt_block_hashes
from tests.scheduler.sched_utils import add, params, step_done


def handler(sched: Scheduler) -> tuple[ControlHandler, list[ControlDone], list[EngineControl]]:
    replies: list[ControlDone] = []
    to_worker: list[EngineControl] = []
    return (ControlHandler(sched.gate, sched.reset_prefix_cache, replies.append,
                           to_worker.append), replies, to_worker)


def test_reset_cache_forgets_every_hash_and_frees_evictable_blocks() -> None:
    bm = BlockManager(8, 4)
    hashes = prompt_block_hashes(np.arange(1, 9, dtype=np.int32), 4)
    held = bm.allocate(2)
    for block, digest in zip(held, hashes, strict=True):
        assert bm.register(block, digest)
    assert bm.lookup(hashes) == held
    bm.free(held[1:])  # one block evictable, one still in use
    assert bm.clear() == 2
    assert bm.lookup(hashes) == [] and bm.num_cached == 0
    assert bm.num_free == 7
    bm.check_invariants()
    bm.free(held[:1])  # its holder lets go: an unhashed block goes back to the free list
    assert bm.num_free == 8
    bm.check_invariants()


def test_pause_holds_every_plan_and_resume_releases_them() -> None:
    sched = Scheduler(params())
    h, replies, _ = handler(sched)
    add(sched, 1, 6)
    plan = sched.build_plan()
    h.on_control(EngineControl(7, "pause"))
    assert replies == [ControlDone(7)]  # at once: nothing waits for the running request
    sched.on_step_done(step_done(plan.plan_id, tokens={1: plan.num_steps}))
    add(sched, 2, 5)
    assert not sched.ready_to_plan()
    h.on_control(EngineControl(8, "resume"))
    assert sched.ready_to_plan()
    nxt = sched.build_plan()
    assert [c.request_id for c in nxt.cont] == [1] and [n.request_id for n in nxt.new] == [2]


def test_sleep_waits_for_running_requests_and_holds_new_ones_until_wake() -> None:
    sched = Scheduler(params())
    h, _, to_worker = handler(sched)
    add(sched, 1, 8, max_new=20)  # two full prompt blocks: cached once registered
    plan = sched.build_plan()
    h.on_control(EngineControl(1, "sleep", level=2))
    add(sched, 2, 5)
    h.forward_ready(len(sched.state.running))
    assert to_worker == []  # request 1 still runs
    assert sched.gate.holds_admission()
    sched.on_step_done(step_done(plan.plan_id, {1: FinishReason.EOS_TOKEN}, {1: 1}))
    assert sched.stats.num_cached_blocks > 0
    h.forward_ready(len(sched.state.running))
    assert [m.op for m in to_worker] == ["sleep"]
    assert sched.stats.num_cached_blocks == 0  # the KV is about to be freed
    assert sched.gate.asleep
    while sched.ready_to_plan():  # drops only: request 2 waits for wake_up
        drops = sched.build_plan()
        assert drops.new == []
        sched.on_step_done(step_done(drops.plan_id))
    h.on_control(EngineControl(2, "wake_up"))
    h.forward_ready(len(sched.state.running))
    assert [m.op for m in to_worker] == ["sleep", "wake_up"]
    assert [n.request_id for n in sched.build_plan().new] == [2]


def test_sleep_while_paused_mid_generation_is_refused_and_load_weights_goes_at_once() -> None:
    sched = Scheduler(params())
    h, replies, to_worker = handler(sched)
    add(sched, 1, 6)
    sched.build_plan()
    h.on_control(EngineControl(1, "pause"))
    h.on_control(EngineControl(2, "sleep", level=1))
    h.on_control(EngineControl(3, "load_weights", path="/new"))
    h.forward_ready(len(sched.state.running))
    assert replies[-1].seq == 2 and "resume" in replies[-1].error
    assert [m.op for m in to_worker] == ["load_weights"]
