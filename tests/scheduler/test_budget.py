"""Per-step token budgets: decoding rows first, prompts' pieces earliest step first, a prompt
starting to decode in the step of its last piece; whole chunks when nothing decodes; the
`--prefill-phase` baseline's per-plan budget."""
from __future__ import annotations

import pytest

from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.budget import (
    Split,
    StepBudget,
    default_tokens,
    largest_piece,
    piece_cost,
)
from tandem_serve.scheduler.core import Scheduler
from tests.scheduler.sched_utils import add, params, step_done
from tests.scheduler.simulation import Simulation, small_cache


def test_a_prompt_spreads_over_the_steps_and_decodes_from_its_last_piece() -> None:
    budget = StepBudget(4, 10)
    budget.decode(0, 4)  # a decoding row: 9 tokens left in every step
    split = budget.split(25, lambda first: 4 - first)
    assert split == Split([9, 9, 7], 2, 2)  # 7 + its first decode token in step 2
    budget.take(split)
    assert budget.left == [0, 0, 1, 8]
    # The next prompt starts where room is, and holds its last token back for the step
    # that has room for its decode row too.
    assert budget.split(5, lambda first: 4 - first) == Split([0, 0, 1, 4], 3, 1)
    assert budget.split(20, lambda first: 4 - first) == Split([0, 0, 1, 8])
    assert budget.split(20, lambda first: 4 - first, limit=4) == Split([0, 0, 1, 3])


def test_decode_rows_of_a_joining_prompt_are_reserved_in_later_steps() -> None:
    budget = StepBudget(3, 6)
    budget.take(Split([0, 0, 6]))  # an older prompt filled the last step
    # Completing in step 0 would need a decode token in steps 1 and 2: step 2 has none.
    assert budget.split(3, lambda first: 3 - first) == Split([2])
    # A prompt with fewer steps left to decode (its limits) may complete.
    assert budget.split(3, lambda first: min(2, 3 - first)) == Split([3], 0, 2)


def test_nothing_decoding_takes_whole_chunks_in_the_first_step() -> None:
    budget = StepBudget(8, 16)
    budget.prefill_only()
    assert budget.split(100, lambda first: 8 - first) == Split([100], 0, 8)
    assert budget.split(200, lambda first: 8 - first) == Split([128])


def test_later_pieces_of_a_prompt_weigh_more() -> None:
    """With attention weighed in, a step carries fewer tokens of a prompt's end than of its
    start, and each piece's cost fits its step."""
    budget = StepBudget(8, 100, attention_tokens=200)
    budget.decode(0, 8)
    split = budget.split(350, lambda first: 8 - first)
    assert split is not None and split.join is not None
    assert split.pieces[0] > split.pieces[split.join - 1] > 0 and sum(split.pieces) == 350
    context = 0
    for n, cost in zip(split.pieces, split.costs, strict=True):
        assert cost == piece_cost(n, context, 200) <= 99
        context += n
    assert largest_piece(99, 0, 0) == 99 and piece_cost(10, 500, 0) == 10


def test_the_baseline_budget_is_per_plan() -> None:
    budget = StepBudget(8, 16, prefill_phase=True)
    budget.decode(0, 8)
    budget.decode(0, 8)
    assert budget.left == [14]
    assert budget.split(13, lambda first: 8) == Split([13], 0, 8)
    assert budget.split(30, lambda first: 8) == Split([14])
    assert Split([13], 0, 8).message_steps() == []


def test_default_budgets() -> None:
    assert default_tokens("cpu", False) == 160 and default_tokens("cuda", False) == 512
    assert default_tokens("cuda", True) == default_tokens("cpu", True) == 2048


def test_plans_place_pieces_per_step_and_count_the_joiners_tokens() -> None:
    sched = Scheduler(params(num_steps=4, max_num_batched_tokens=8, max_model_len=128,
                             num_blocks=64))
    add(sched, 1, 3, max_new=40)
    add(sched, 2, 3, max_new=40)
    plan0 = sched.build_plan()  # nothing decoded before: whole chunks in step 0
    assert [n.prefill_steps for n in plan0.new] == [[], []]
    sched.on_step_done(step_done(0, tokens={1: 4, 2: 4}))
    sched.on_plan_processed(PlanProcessed(0, 0))
    add(sched, 3, 20, max_new=40)
    plan1 = sched.build_plan()
    [new] = plan1.new
    # Two decoding rows leave 6 tokens a step: 6, 6, 6 and the last one with its decode row.
    assert new.prefill_steps == [6, 6, 6, 1] and new.num_prefill_tokens == 19
    req = sched.state.requests[3]
    assert req.num_tokens == 21 and req.num_computed == 20, "one decode step: the last"
    assert len(new.block_ids) == 5  # 20 positions of 4
    sched.check_invariants()


@pytest.mark.parametrize("num_steps", [1, 8])
def test_random_workload_baseline_prefill_phase(num_steps: int) -> None:
    params = small_cache(num_steps, True, prefill_phase=True, pace_plans=True)
    stats = Simulation(params, seed=num_steps * 3 + 2).run().sched.stats
    assert stats.num_preemptions > 0 and stats.num_failed > 0


def test_random_workload_large_steps_tight_budget() -> None:
    # Long plans over a budget near the batch size: pieces in every step, joins late.
    params = small_cache(16, True, max_num_seqs=6, max_num_batched_tokens=8, num_blocks=60)
    Simulation(params, seed=9, num_requests=80).run()


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_random_workload_attention_weighed(async_mode: bool) -> None:
    params = small_cache(8, async_mode, attention_tokens=12, max_num_batched_tokens=16)
    stats = Simulation(params, seed=31 + async_mode).run().sched.stats
    assert stats.num_preemptions > 0
