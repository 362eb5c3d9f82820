"""Which rows speculate: the measured step cost, the rule over it, what the rule learns from a
plan, and a runner whose rule picks no row running plain steps with the same output."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.spec.policy import REPEATS, SpecPolicy, StepCost
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.speculative import parse_speculative
from tandem_serve.proto.token_messages import TokenBatch
from tests.gpu_worker.model_utils import make_copier_checkpoint
from tests.gpu_worker.runner_driver import Driver

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'


def linear(c0: float, c1: float):  # type: ignore[no-untyped-def]
    """A CPU-like cost: every row pays its matmuls."""
    return lambda rows: c0 + c1 * rows


def flat_until(knee: int):  # type: ignore[no-untyped-def]
    """A GPU-like cost: memory-bound (flat) up to `knee` rows, then compute-bound."""
    return lambda rows: max(1.0, rows / knee)


def req(rid: int, rate: float = -1.0, **sampling: float) -> RequestState:
    r = RequestState(rid, [1, 2, 3], 3, SamplingParams(**sampling))  # type: ignore[arg-type]
    r.spec_rate = rate
    return r


def test_step_cost_measures_each_power_of_two_once_and_interpolates() -> None:
    calls: list[int] = []

    def measure(rows: int) -> float:
        calls.append(rows)
        return float(rows) + (5.0 if len(calls) == 1 else 0.0)  # a slow first-use warm-up

    cost = StepCost(measure)
    assert cost(4) == 4.0
    assert cost(6) == 6.0  # between 4 and 8
    assert cost(5) == 5.0 and cost(8) == 8.0 and cost(1) == 1.0
    assert sorted(set(calls)) == [1, 4, 8]
    assert len(calls) == 3 * (1 + REPEATS)  # a warm-up and the timed runs, never again


def test_step_cost_primes_up_to_its_cap_and_extends_the_last_slope() -> None:
    calls: list[int] = []

    def measure(rows: int) -> float:
        calls.append(rows)
        return 1.0 + 0.5 * rows

    cost = StepCost(measure, cap=64)
    cost.prime()
    assert sorted(set(calls)) == [1, 2, 4, 8, 16, 32, 64]
    assert cost(200) == pytest.approx(101.0) and cost(48) == pytest.approx(25.0)
    assert sorted(set(calls)) == [1, 2, 4, 8, 16, 32, 64]  # nothing measured while serving


@pytest.mark.parametrize("cost, batch, want", [
    (linear(1.0, 0.3), 1, 1),  # a CPU at batch 1: k rows cost less than 2 tokens earn
    (linear(1.0, 0.3), 32, 0),  # ... at batch 32 they cost more
    (flat_until(64), 32, 8),  # a GPU below its knee: nearly free rows, up to the knee
    (flat_until(64), 1, 1),
])
def test_rows_speculate_while_they_raise_tokens_per_second(cost, batch: int,  # type: ignore[no-untyped-def]
                                                           want: int) -> None:
    policy = SpecPolicy(4, cost)
    reqs = [req(i) for i in range(batch)]
    assert len(policy.choose(reqs, [True] * batch)) == want


def test_best_estimates_first_and_ineligible_rows_never() -> None:
    policy = SpecPolicy(4, linear(1.0, 0.05))
    reqs = [req(0, 0.2), req(1, 3.5), req(2, 3.9), req(3, 0.0), req(4, 3.9)]
    chosen = policy.choose(reqs, [True, True, True, True, False])
    assert chosen == [1, 2]  # in batch order; 4 is not eligible, 0 and 3 do not pay
    policy.always = True
    assert policy.choose(reqs, [True, True, True, True, False]) == [0, 1, 2, 3]


def test_learning_from_a_plan_and_drifting_back() -> None:
    policy = SpecPolicy(4, linear(1.0, 0.3))
    reqs = [req(0), req(1, 3.0), req(2, 0.0), req(3)]
    policy.learn(reqs, [0, 1, 3], steps=[8, 8, 0], accepted=[24, 8, 0])
    assert reqs[0].spec_rate == 3.0  # first measurement taken as is
    assert reqs[1].spec_rate == 2.0  # averaged with what it had
    assert reqs[3].spec_rate == -1.0  # no verify step: nothing learnt
    assert reqs[2].spec_rate == pytest.approx(0.2 * policy.prior)  # toward the prior
    for _ in range(30):
        policy.learn(reqs, [], [], [])
    assert reqs[2].spec_rate == pytest.approx(policy.prior, abs=0.01)


@pytest.fixture(scope="module")
def copier(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_copier_checkpoint(Path(tmp_path_factory.mktemp("ckpt")), tokenizer=False)


def _outputs(model: str, spec: str, cost) -> tuple[dict[int, list[int]], Driver]:  # type: ignore[no-untyped-def]
    runner = ModelRunner(WorkerConfig(model, device="cpu", dtype="float32", num_kv_blocks=200,
                                      block_size=4, speculative=parse_speculative(spec)))
    d = Driver(runner)
    if runner.speculation is not None:
        runner.speculation.policy.always = False
        runner.speculation.policy.cost = cost
    for i in range(6):
        d.add(i, [5 + i, 9, 5 + i, 9, 5 + i], SamplingParams(max_new_tokens=20))
    for _ in range(10):
        d.run(4)
    return d.outputs(), d


def test_a_plan_whose_rule_picks_no_row_runs_plain_steps(copier: str) -> None:
    want, _ = _outputs(copier, "", None)
    got, d = _outputs(copier, SPEC, linear(1.0, 1.0))  # every row costs a whole step
    assert got == want
    assert all(done.num_drafts == 0 for done in d.done)
    # One token per row per step: plain steps, not verify steps with empty drafts.
    steps = {m.step for m in d.messages if isinstance(m, TokenBatch)}
    assert steps <= set(range(-1, 4))  # -1: first tokens after prefill-only plans
    got, d = _outputs(copier, SPEC, flat_until(64))  # free rows: everyone speculates
    assert got == want
    assert sum(done.num_drafts for done in d.done) > 0


def test_a_verify_step_shows_its_draft_and_verify_spans(copier: str) -> None:
    from tandem_serve.ipc.tracing import TRACER

    TRACER.start()
    try:
        _, d = _outputs(copier, SPEC, flat_until(64))
    finally:
        data = TRACER.stop()
    spans = [(s[0], s[3], s[4]) for s in data["spans"]]
    verify_steps = {(plan, step) for name, plan, step in spans if name == "verify"}
    assert verify_steps and all(p >= 0 and s >= 0 for p, s in verify_steps)
    # Each inside a step's forward, after its drafts.
    assert verify_steps <= {(plan, step) for name, plan, step in spans if name == "forward"}
    assert verify_steps == {(plan, step) for name, plan, step in spans if name == "draft"}
