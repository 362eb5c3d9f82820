"""Mixed steps: prefill chunk pieces inside the K decode steps, against the same requests run
separately (logits, float32) and against HF generate, with the real scheduler planning the
pieces (`served.Served`): K=8 async and K=1 sync, preemption, prefix hits mid-prompt, prompt
logprobs, seeds, and the host-sync guard on every step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend
from tandem_serve.gpu_worker.batch import build_decode_batch
from tandem_serve.gpu_worker.graphs.piecewise import MixedGraphs
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.steps import lay_out, prefill_inputs, prefill_metadata
from tandem_serve.proto.plan_messages import NewRequest, StepPlan
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.token_messages import TokenBatch
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import NEW_TOKENS, Driver, hf_greedy, make_runner, sampled
from tests.gpu_worker.served import Served
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.triton_utils import use_backend

ATOL = 1e-5


def greedy(n: int = NEW_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_token_ids=[EOS_ID], **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- one step


@pytest.mark.parametrize("flex", [False, True], ids=["split", "flex"])
@torch.inference_mode()
def test_mixed_step_logits_equal_the_requests_run_separately(
        llama: str, flex: bool) -> None:
    """One forward over decode rows and prefill pieces (one completing its prompt, whose
    decode row reads the piece from the same forward; one mid-prompt after a cached part)
    gives the logits and KV of a prefill forward followed by a decode forward, whichever
    attention path the mixed forward takes."""
    runner = make_runner(llama, attention_backend="flex" if flex else "sdpa")
    d = Driver(runner, seed=4)
    short, other, joiner, long = random_prompts([30, 52, 61, 140], 512, seed=8)
    d.add(0, short)
    d.add(1, other)
    d.add(3, long, chunk=48)  # its first 48 positions are in the cache from here on
    d.run(2)
    blocks = [d.free.pop() for _ in range(5)]
    runner.apply(StepPlan(9, 4, new=[NewRequest(2, np.array(joiner, np.int32), greedy(),
                                                blocks, 0, 60)]))
    req3 = runner.requests[3]
    req3.prefill_chunk, req3.block_ids = 70, req3.block_ids + [d.free.pop() for _ in range(5)]
    layout = lay_out(runner.requests.values(), 4, False)
    assert sorted(p.req.request_id for p in layout.steps[0]) == [2, 3]
    assert len(layout.decoding) == 3 and layout.join_steps == [0, 0, 0]
    batch = build_decode_batch(layout.decoding, runner.vocab_size, runner.device, None,
                               layout.join_steps)
    pre = runner.executor.step_inputs(layout.steps[0], batch, [0, 0, 0])
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with forbid_host_sync():
        mixed, hidden = runner.executor.forward_mixed(batch, 0, pre)
        mixed_prefill = runner.model.compute_logits(hidden)
    after_mixed = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    runner.model.attention = SdpaBackend()  # the reference: plain SDPA
    alone = prefill_inputs(layout.steps[0], runner.block_size, runner.device)
    hidden_alone = runner.model(alone.ids, alone.positions, runner.kv_caches,
                                prefill_metadata(alone))
    separate = runner.executor.forward_decode(batch.input_ids, batch.positions, batch.active,
                                     batch.block_tables, batch.max_position + 1)
    # FlexAttention's softmax runs in base 2 (exp2 of log2-scaled scores): other roundings.
    atol = 1e-4 if flex else ATOL
    torch.testing.assert_close(mixed, separate, atol=atol, rtol=0)
    torch.testing.assert_close(mixed_prefill, runner.model.compute_logits(hidden_alone),
                               atol=atol, rtol=0)
    for (k, v), (km, vm) in zip(runner.kv_caches, after_mixed, strict=True):
        torch.testing.assert_close(k[:-1], km[:-1], atol=atol, rtol=0)  # scratch aside
        torch.testing.assert_close(v[:-1], vm[:-1], atol=atol, rtol=0)


# ---------------------------------------------------------------------------- served


def _workload(served: Served, new: tuple[int, int] = (40, NEW_TOKENS)) -> dict[int, list[int]]:
    """Three streams decoding while two long prompts arrive, one after the other; `new`:
    the streams' and the long prompts' token counts."""
    p = random_prompts([9, 23, 15, 170, 130], 512, seed=17)
    for rid in range(3):
        served.add(rid, p[rid], greedy(new[0]))
    served.add(3, p[3], greedy(new[1]), after_plans=2)
    served.add(4, p[4], greedy(new[1]), after_plans=4)
    served.prompts = p  # type: ignore[attr-defined]
    return served.run()


def _mixed_forwards(runner: ModelRunner) -> list[tuple[int, list[int]]]:
    """Each mixed forward's decode row count and prefill rows' context lengths, from then on
    (every forward's attention plan passes through the backend's `prepare`)."""
    seen: list[tuple[int, list[int]]] = []
    attention = runner.model.attention
    prepare = attention.prepare

    def spy(meta: AttentionMetadata, *args: Any) -> Any:
        if meta.is_mixed:
            seen.append((meta.num_decode, list(meta.prefill_seq_lens or [])))
        return prepare(meta, *args)

    attention.prepare = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("k, async_mode, backend, pieces", [
    (8, True, "auto", False), (1, False, "auto", False), (4, True, "auto", False),
    (8, True, "flex", False), (8, True, "flex", True), (1, False, "auto", True),
    (1, False, "triton", True)])
def test_prompts_prefill_inside_the_steps_and_equal_hf(
        request: pytest.FixtureRequest, llama: str, k: int, async_mode: bool, backend: str,
        pieces: bool) -> None:
    """`pieces`: mixed steps through the piecewise-graph cut (`gpu_worker.graphs.piecewise`),
    run as plain calls here, as CUDA runs them from graphs.  `triton`: the Triton kernels
    under the interpreter, the very kernels a GPU runs (K=8 async with preemption and
    prefix hits: test_kv_fp8).  The interpreter runs each decode row's program in Python:
    there the streams stop at 20 tokens, still decoding while both long prompts prefill, and
    those decode 6."""
    new = (20, 6) if backend == "triton" else (40, NEW_TOKENS)
    runner = make_runner(llama, attention_backend=use_backend(request, backend))
    if pieces:
        runner.executor.mixed_graphs = MixedGraphs(runner.model, 64, capture=False)
    runner.step_guard = forbid_host_sync
    mixed = _mixed_forwards(runner)
    served = Served(runner, k, async_mode, budget=24)
    out = _workload(served, new)
    prompts = served.prompts  # type: ignore[attr-defined]
    for rid in range(5):
        assert out[rid] == hf_greedy(llama, prompts[rid], new[rid >= 3]), rid
    # Both long prompts' last pieces (a prompt's last token is its first decode row's) ran
    # in a forward with other requests' decode rows (a completing piece brings one row).
    shared = {n for rows, lens in mixed if rows > len(lens) for n in lens}
    assert {len(prompts[3]) - 1, len(prompts[4]) - 1} <= shared, mixed
    if k > 1:  # the long prompts were cut into pieces over several steps
        spread = served.spread()
        assert spread and max(len(s) for s in spread) >= 4
    if pieces:
        assert runner.executor.mixed_graphs is not None and runner.executor.mixed_graphs.graphs
    served.close()


def test_the_baseline_prefill_phase_gives_the_same_tokens(llama: str) -> None:
    mixed = Served(make_runner(llama), 8, True, budget=24)
    phase = Served(make_runner(llama), 8, True, budget=64, prefill_phase=True)
    assert _workload(mixed) == _workload(phase)
    assert not phase.spread() and all(p.prefill_phase for p in phase.plans)
    mixed.close()
    phase.close()


def test_preemption_and_prefix_hits_mid_prompt(llama: str) -> None:
    """A cache too small for every stream: preempted requests re-prefill in pieces; prompts
    sharing a 64-token prefix hit the cache in the middle of their prompt."""
    runner = make_runner(llama, num_kv_blocks=16)
    runner.step_guard = forbid_host_sync
    served = Served(runner, 8, True, budget=20)
    base, *tails = random_prompts([64, 40, 70, 30, 55], 512, seed=23)
    prompts = [base + tails[0], base + tails[1], tails[2], base + tails[3]]
    for rid, prompt in enumerate(prompts):
        served.add(rid, prompt, greedy(60), after_plans=rid)
    out = served.run()
    stats = served.sched.stats
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens >= 64
    for rid, prompt in enumerate(prompts):
        assert out[rid] == hf_greedy(llama, prompt, 60), rid
    served.close()


def test_prompt_logprobs_and_seeds_in_mixed_steps(llama: str, tmp_path: Path) -> None:
    """A prompt scored piece by piece over the steps gives the baseline's scores (and no
    token before its detail); a seeded request samples the same tokens beside prefills."""
    prompts = random_prompts([20, 150, 12], 512, seed=29)
    scored = greedy(6, prompt_logprobs=True, top_n=3)
    seeded = sampled(77, repetition_penalty=1.2)
    runs = []
    for phase in (False, True):
        runner = make_runner(llama)
        runner.step_guard = forbid_host_sync
        served = Served(runner, 8, True, budget=16 if not phase else 512, prefill_phase=phase)
        served.add(0, prompts[0], greedy(40))
        served.add(2, prompts[2], seeded)
        served.add(1, prompts[1], scored, after_plans=1)
        out = served.run()
        parts = served.details(1)
        assert parts[-1].last and sum(len(x.token_ids) for x in parts) == len(prompts[1]) - 1
        first = next(i for i, m in enumerate(served.messages) if isinstance(m, TokenBatch)
                     and 1 in m.request_ids[m.token_ids >= 0].tolist())
        assert served.messages.index(parts[-1]) < first
        runs.append((out, np.concatenate([x.logprobs for x in parts]),
                     np.concatenate([x.top_ids for x in parts])))
        served.close()
    (mixed, lp, top), (phase_out, lp_phase, top_phase) = runs
    assert mixed == phase_out
    np.testing.assert_allclose(lp, lp_phase, atol=1e-4, rtol=0)  # float32 sums of ~30
    np.testing.assert_array_equal(top, top_phase)
    alone = Served(make_runner(llama), 8, True, budget=16)
    alone.add(2, prompts[2], seeded)
    assert alone.run()[2] == mixed[2] and len(set(mixed[2])) > 4
    alone.close()
