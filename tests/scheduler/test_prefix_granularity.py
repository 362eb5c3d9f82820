"""A hybrid model's prefix hits end where the gpu worker checkpointed its recurrent states:
on a multiple of `prefix_granularity` blocks (`WorkerReady.state_checkpoint_blocks`), the
longest such run of cached blocks, or nothing."""
from __future__ import annotations

from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.plan_messages import WorkerReady
from tandem_serve.scheduler.core import Scheduler
from tandem_serve.scheduler.main import make_params
from tests.scheduler.sched_utils import add, params


def test_hits_are_cut_to_whole_checkpoint_spans() -> None:
    sched = Scheduler(params(num_steps=1, prefix_granularity=2))
    prompt = list(range(100, 120))  # five full blocks of 4
    add(sched, 1, prompt)
    sched.build_plan()  # request 1's prompt blocks are registered from here on
    add(sched, 2, [*prompt, 9])  # 5 cacheable blocks: 4 of them, ending on a checkpoint
    add(sched, 3, prompt[:11] + [7] * 9)  # 2 cached blocks (then other tokens)
    add(sched, 4, prompt[:7] + [7] * 9)  # 1 cached block: less than a span, no hit
    plan = sched.build_plan()
    cached = {n.request_id: n.num_cached_tokens for n in plan.new}
    assert cached == {2: 16, 3: 8, 4: 0}
    sched.check_invariants()


def test_worker_ready_sets_the_granularity_or_turns_hits_off() -> None:
    cfg = ServerConfig(model="m")
    ready = WorkerReady(100, 16, 1024, 512, recurrent_state=True, state_checkpoint_blocks=4)
    assert make_params(cfg, ready).prefix_granularity == 4
    assert make_params(cfg, ready).enable_prefix_caching
    off = WorkerReady(100, 16, 1024, 512, recurrent_state=True)
    assert not make_params(cfg, off).enable_prefix_caching
    dense = WorkerReady(100, 16, 1024, 512)
    assert make_params(cfg, dense).prefix_granularity == 1
