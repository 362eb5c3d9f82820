"""ModelRunner.execute driven by hand-built StepPlans, against HF generate (float32).

No processes: `Driver` (runner_driver.py) plays the scheduler and checks every plan's
TokenBatches and StepDone against each other.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import tandem_serve.gpu_worker.runner as runner_module
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import TokenBatch
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import (
    CONFIGS,
    NEW_TOKENS,
    Driver,
    checkpoint,
    hf_greedy,
    make_runner,
    sampled,
)
from tests.gpu_worker.sync_guard import HostSyncError, forbid_host_sync

# ---------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf_with_requests_joining_and_leaving(ckpt_root: Path, name: str) -> None:
    path = checkpoint(ckpt_root, name)
    d = Driver(make_runner(path), seed=len(name))
    p = random_prompts([1, 33, 300, 7, 128, 60], 512, seed=len(name))
    for rid in (0, 1, 2):
        d.add(rid, p[rid])
    d.run(1)
    d.add(3, p[3])  # joins while the others decode
    d.run(4)
    d.add(4, p[4])
    d.add(5, p[5])
    d.run(8)
    d.drop(1)  # aborted mid-stream
    d.run(4)
    d.run_until_done([8, 1, 4])
    for rid in (0, 2, 3, 4, 5):
        assert d.reqs[rid].out == hf_greedy(path, p[rid]), f"request {rid}"
    dropped = d.reqs[1].out
    assert len(dropped) == 13 and dropped == hf_greedy(path, p[1])[:13]
    assert 1 not in d.runner.requests
    full = [len(set(hf_greedy(path, p[r]))) for r in (0, 2, 3, 4, 5)]
    assert max(full) >= 8, "parity only means something if the output varies"


def test_plan_ending_comes_once_with_the_lead_asked_for(llama: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Paced planning: the notice comes at the latest step that leaves `lead_s` of work."""
    # Each decode step "takes" exactly 1 s on the runner's clock, so where the notice lands
    # depends on the rule alone, not on how busy the machine is.
    ticks = itertools.count()
    clock = SimpleNamespace(monotonic=time.monotonic, perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(runner_module, "time", clock)
    d = Driver(make_runner(llama), seed=3)
    long_prompt, *short = random_prompts([200, 20, 30], 512, seed=13)
    notices: list[int] = []  # decode steps of the plan run before each notice
    steps_run = 0
    decode_step = d.runner.decode_step

    def counted(*args: Any) -> Any:
        nonlocal steps_run
        steps_run += 1
        return decode_step(*args)

    d.runner.decode_step = counted  # type: ignore[method-assign]

    def run(lead_s: float) -> None:
        nonlocal steps_run
        steps_run = 0
        d.run(8, ending=lambda: notices.append(steps_run), lead_s=lead_s)

    d.add(0, long_prompt, chunk=64)
    run(0.0)  # prefill only: no steps to time, so at once
    d.prefill(0, 200 - 1 - 64)
    d.add(1, short[0])
    d.add(2, short[1])
    run(0.0)  # no lead: before the last step
    run(60.0)  # more than a whole plan: before step 0
    assert d.runner._step_s == 1.0
    run(2.5)  # 2.5 steps' worth: the notice comes with 2 steps still to run
    assert notices == [0, 7, 0, 5]
    d.run(8)  # no callback: nothing happens
    assert len(notices) == 4


def test_chunked_prefill_across_plans(llama: str) -> None:
    long_prompt, other = random_prompts([300, 50], 512, seed=11)
    d = Driver(make_runner(llama), seed=1)
    d.add(0, other)
    d.add(1, long_prompt, chunk=100)  # chunk ends off a block boundary
    d.run(4)
    assert d.reqs[1].out == [] and len(d.reqs[0].out) == 4
    d.prefill(1, 77)
    d.run(4)
    d.prefill(1, 122)  # the rest: it decodes in the same plan
    done = d.run(4)
    assert 1 in done.request_ids.tolist() and len(d.reqs[1].out) == 4
    d.run_until_done([8])
    assert d.reqs[1].out == hf_greedy(llama, long_prompt)
    assert d.reqs[0].out == hf_greedy(llama, other)


def test_preempt_and_resume_continue_the_same_output(llama: str) -> None:
    a, b = random_prompts([70, 90], 512, seed=12)
    d = Driver(make_runner(llama), seed=2)
    d.add(0, a)
    d.run(4)
    d.run(4)
    d.preempt(0)
    d.add(1, b)  # takes request 0's freed blocks first and overwrites them
    d.run(4)
    d.resume(0, chunk=40)  # re-prefill its history (prompt + 8 outputs) in two chunks
    d.run(4)
    assert len(d.reqs[0].out) == 8
    d.prefill(0, len(d.reqs[0].history) - 1 - 40)
    d.run_until_done([8, 4])
    assert d.reqs[0].out == hf_greedy(llama, a)
    assert d.reqs[1].out == hf_greedy(llama, b)


def test_prefix_reuse_from_another_requests_blocks(llama: str) -> None:
    base, tail = random_prompts([100, 37], 512, seed=21)
    d = Driver(make_runner(llama), seed=3)
    d.add(0, base)
    d.run(4)
    prompt = base[:64] + tail
    d.add(1, prompt, shared=d.reqs[0].blocks[:4], cached=64)
    d.run_until_done([8])
    assert d.reqs[1].out == hf_greedy(llama, prompt)
    assert d.reqs[0].out == hf_greedy(llama, base)


# ---------------------------------------------------------------------------- sampling


def test_seeded_request_is_the_same_alone_and_in_a_batch(llama: str) -> None:
    prompts = random_prompts([40] + [5 + 13 * i for i in range(16)], 512, seed=31)
    target = sampled(1234, repetition_penalty=1.2)
    alone = Driver(make_runner(llama), seed=4)
    alone.add(0, prompts[0], target)
    alone.run_until_done([4])
    busy = Driver(make_runner(llama), seed=5)
    for i, p in enumerate(prompts[1:], start=1):
        other = sampled(i, temperature=0.5 + 0.1 * (i % 5), top_p=0.8) if i % 2 else None
        busy.add(i, p, other)
    busy.run(1)
    busy.add(0, prompts[0], target)  # joins a running batch of 16
    busy.run_until_done([8, 1])
    assert busy.reqs[0].out == alone.reqs[0].out
    assert len(alone.reqs[0].out) == NEW_TOKENS and len(set(alone.reqs[0].out)) > 4


# ---------------------------------------------------------------------------- finishing


def test_finishes_inside_a_plan_are_masked_and_reported(llama: str) -> None:
    p = random_prompts([20, 30, 45], 512, seed=41)
    ref = hf_greedy(llama, p[0], 12)
    stop_at = next(i for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    d = Driver(make_runner(llama, max_model_len=48), seed=6)
    d.add(0, p[0], SamplingParams(max_new_tokens=100, stop_token_ids=[EOS_ID, ref[stop_at]]))
    d.add(1, p[1], SamplingParams(max_new_tokens=5))
    d.add(2, p[2], SamplingParams(max_new_tokens=100))  # 45 + 3 = max_model_len 48
    d.run(1)
    done = d.run(8)  # all three finish in this plan, at different steps
    assert d.reqs[0].out == ref[: stop_at + 1]
    assert d.reqs[0].finish == FinishReason.EOS_TOKEN
    assert d.reqs[1].out == hf_greedy(llama, p[1], 5)
    assert d.reqs[1].finish == FinishReason.MAX_TOKENS
    assert d.reqs[2].out == hf_greedy(llama, p[2], 3)
    assert d.reqs[2].finish == FinishReason.TOKEN_LIMIT
    counts = dict(zip(done.request_ids.tolist(), done.num_tokens.tolist(), strict=True))
    assert counts == {0: stop_at, 1: 4, 2: 2}
    assert sorted(done.finished_ids.tolist()) == [0, 1, 2]
    # Sync mode: the next plan publishes after its last step; finished rows are dropped first.
    d.add(3, p[1], SamplingParams(max_new_tokens=6))
    d.run(8, per_step=False)
    assert d.reqs[3].out == hf_greedy(llama, p[1], 6)
    assert set(d.runner.requests) == {3}


def test_a_row_finishing_at_its_last_block_boundary_stays_masked(llama: str) -> None:
    """Finished, a row's position points one past its blocks (31 + 1 = 32, two blocks)."""
    [p] = random_prompts([31], 512, seed=42)
    d = Driver(make_runner(llama), seed=8)
    d.add(0, p, SamplingParams(max_new_tokens=2))
    d.run(1)
    d.run(8)
    assert len(d.reqs[0].blocks) == 2
    assert d.reqs[0].out == hf_greedy(llama, p, 2)


# ---------------------------------------------------------------------------- host syncs


def test_k_step_loop_never_reads_the_device(llama: str) -> None:
    """Every step of every plan, publishing included, runs under forbid_host_sync()."""
    runner = make_runner(llama)
    runner.step_guard = forbid_host_sync
    p = random_prompts([9, 40, 77, 20], 512, seed=51)
    d = Driver(runner, seed=7)
    d.add(0, p[0])  # greedy only: the all-greedy sampler path
    d.run(4)
    d.add(1, p[1], sampled(1))  # top-p / top-k
    d.add(2, p[2], SamplingParams(repetition_penalty=1.3, min_new_tokens=3,
                                  frequency_penalty=0.5, presence_penalty=0.2,
                                  max_new_tokens=NEW_TOKENS, stop_token_ids=[EOS_ID]))
    d.add(3, p[3], sampled(2, logprobs=True, top_n=4, top_k=0, min_p=0.05))
    d.run(4)
    d.run(8)
    batch = [m for m in d.messages if isinstance(m, TokenBatch)][-1]
    assert batch.logprobs is not None and batch.top_ids is not None
    assert batch.top_ids.shape == (4, 4)
    assert d.reqs[0].out == hf_greedy(llama, p[0])[:16]
    assert len(d.reqs[2].out) >= 3, "min_new_tokens held the stop ids back"

    # The guard is really on inside the loop: a host read there fails the plan.
    def reads_host(*args: Any) -> Any:
        raise_if = original(*args)
        raise_if.token_ids.tolist()
        return raise_if

    original = runner.decode_step
    runner.decode_step = reads_host  # type: ignore[method-assign]
    with pytest.raises(HostSyncError):
        d.run(1)
