"""What the sampler returns besides the token (logprobs, ranks, top-n), and that none of
its paths reads the device from the host.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from tandem_serve.gpu_worker.sampling.sampler import (
    Sampler,
    SamplerHints,
    SamplerOutput,
    SamplingBatch,
)
from tests.gpu_worker.sampler_utils import (
    DEFAULTS,
    MIXED_ROWS,
    hf_reference,
    history,
    make_rows,
    seen_mask,
    threshold_strategy,  # noqa: F401  (a fixture; tests name it in usefixtures)
)
from tests.gpu_worker.sync_guard import forbid_host_sync

# ---------------------------------------------------------------- logprobs


def check_logprobs(out: SamplerOutput, ref_lp: Tensor, n: int) -> None:
    assert out.logprobs is not None and out.ranks is not None
    assert out.top_ids is not None and out.top_logprobs is not None
    chosen = ref_lp.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen)
    expected_rank = (ref_lp > chosen.unsqueeze(1)).sum(1) + 1
    assert torch.equal(out.ranks.long(), expected_rank)
    assert out.ranks.dtype == torch.int32 and out.top_ids.shape == (ref_lp.shape[0], n)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, ref_lp.gather(1, out.top_ids))
    torch.testing.assert_close(out.top_logprobs, ref_lp.topk(n, 1).values)
    first = out.ranks == 1
    assert torch.equal(first, out.logprobs == out.top_logprobs[:, 0])
    assert torch.equal(out.token_ids[first], out.top_ids[first, 0])


@pytest.mark.usefixtures("threshold_strategy")
def test_logprobs_ranks_and_top_n() -> None:
    rng = torch.Generator().manual_seed(13)
    rows = [{k: v for k, v in r.items() if k != "out"} for r in MIXED_ROWS] * 4
    vocab, prompt_len = 700, DEFAULTS["prompt_len"]
    logits = torch.randn(len(rows), vocab, generator=rng) * 2
    hist = history(rng, len(rows), prompt_len, [3] * len(rows), vocab)
    st, hints = make_rows([{**r, "seed": i} for i, r in enumerate(rows)])
    oc = torch.full((len(rows),), 3, dtype=torch.int32)
    out = Sampler()(logits, SamplingBatch(st, hints=hints, seen=seen_mask(hist, vocab),
                                          any_penalty=True, need_logprobs=True, max_top_n=5), oc)
    # Reference: HF's processors up to and including temperature, no truncation.
    pre = [{k: v for k, v in r.items() if k not in ("top_k", "top_p", "typical_p", "min_p")}
           for r in rows]
    scaled = hf_reference(logits, pre, hist, prompt_len)
    ref_lp = torch.log_softmax(scaled, 1)
    check_logprobs(out, ref_lp, 5)
    assert out.ranks is not None
    assert (out.ranks[st.temperature == 0] == 1).all()
    assert (out.ranks > 1).any()


def test_logprobs_all_greedy() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(14))
    st, hints = make_rows([{"temperature": 0.0}] * 6)
    out = Sampler()(logits, SamplingBatch(st, hints=hints, all_greedy=True, need_logprobs=True,
                                          max_top_n=4), torch.zeros(6, dtype=torch.int32))
    check_logprobs(out, torch.log_softmax(logits, 1), 4)
    assert out.ranks is not None and bool((out.ranks == 1).all())
    none = Sampler()(logits, SamplingBatch(st, all_greedy=True), torch.zeros(6, dtype=torch.int32))
    assert none.logprobs is none.ranks is none.top_ids is none.top_logprobs is None


# ---------------------------------------------------------------- host-sync freedom


@pytest.mark.parametrize("all_greedy,any_penalty,need_logprobs,max_top_n,tight",
                         list(itertools.product([False, True], [False, True], [False, True],
                                                [0, 3], [False, True])))
def test_runs_under_forbid_host_sync(all_greedy: bool, any_penalty: bool, need_logprobs: bool,
                                     max_top_n: int, tight: bool) -> None:
    rows = [{k: v for k, v in r.items() if k != "out"} for r in MIXED_ROWS]
    if all_greedy:
        rows = [{**r, "temperature": 0.0} for r in rows]
    st, hints = make_rows(rows)
    logits = torch.randn(len(rows), 256)
    seen = torch.rand(len(rows), 256) < 0.1
    oc = torch.full((len(rows),), 2, dtype=torch.int32)
    sampler = Sampler()
    with forbid_host_sync():
        loose = hints if tight else SamplerHints()
        out = sampler(logits, SamplingBatch(st, loose, seen if any_penalty else None,
                                            all_greedy=all_greedy, any_penalty=any_penalty,
                                            need_logprobs=need_logprobs, max_top_n=max_top_n), oc)
        sampler.warped_logits(logits, SamplingBatch(st, loose, seen, any_penalty=True), oc)
    assert out.token_ids.shape == (len(rows),)


def test_runs_under_forbid_host_sync_with_top_k_domain() -> None:
    rows = [{"temperature": 0.8, "top_k": k, "top_p": p, "typical_p": t, "min_p": m, "seed": i}
            for i, (k, p, t, m) in enumerate([(5, 1.0, 1.0, 0.0), (30, 0.9, 1.0, 0.1),
                                              (12, 0.5, 0.8, 0.0)])]
    rows.append({"temperature": 0.0})
    st, hints = make_rows(rows)
    assert hints.max_top_k == 30
    logits = torch.randn(len(rows), 1000)
    with forbid_host_sync():
        out = Sampler()(logits, SamplingBatch(st, hints=hints, need_logprobs=True, max_top_n=2),
                        torch.zeros(4, dtype=torch.int32), inplace=True)
    assert out.token_ids.shape == (4,)
