"""The batched sampler against Hugging Face's logits processors, and greedy decoding."""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

import tandem_serve.gpu_worker.sampling.sampler as sampler_mod
from tandem_serve.gpu_worker.sampling.sampler import Sampler, SamplerHints, SamplingBatch
from tests.gpu_worker.sampler_utils import (
    DEFAULTS,
    MIXED_ROWS,
    check_against_hf,
    hf_reference,
    history,
    make_rows,
    seen_mask,
    threshold_strategy,  # noqa: F401  (a fixture; tests name it in usefixtures)
)

# ---------------------------------------------------------------- processors vs HF


def test_threshold_strategies_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = torch.Generator().manual_seed(21)
    rows, width = 64, 700
    # Few distinct keys (many ties), spread keys, and keys near both ends of the range.
    keys = torch.cat([torch.randint(0, 20, (16, width), generator=rng),
                      torch.randint(0, 1 << 31, (16, width), generator=rng),
                      torch.randint(0, 1 << 12, (16, width), generator=rng),
                      (1 << 31) - 1 - torch.randint(0, 5000, (16, width), generator=rng)])
    keys = keys.to(torch.int32)
    weights = torch.randint(0, 1 << 40, (rows, width), generator=rng)
    weights[::3, ::2] = 0
    total = weights.sum(1)
    for frac in (0.0, 1e-9, 0.3, 0.9, 1.0):
        target = (total.double() * frac).ceil().long().clamp(min=1)
        radix = sampler_mod._radix_select(keys, weights, target)
        ref = torch.tensor([_brute_threshold(keys[i], weights[i], int(target[i]))
                            for i in range(rows)], dtype=torch.int32)
        assert torch.equal(radix, ref), frac
        monkeypatch.setattr(sampler_mod, "_SORT_MAX_WIDTH", 1 << 30)
        assert torch.equal(sampler_mod._threshold(keys, weights, target), ref)
        monkeypatch.undo()


def _brute_threshold(keys: Tensor, weights: Tensor, target: int) -> int:
    """O(W^2) reference: the largest key t whose mass at or above t reaches the target."""
    at_or_above = ((keys.unsqueeze(0) >= keys.unsqueeze(1)) * weights.unsqueeze(0)).sum(1)
    return int(keys[at_or_above >= target].max())


@pytest.mark.usefixtures("threshold_strategy")
def test_repetition_penalty_matches_hf() -> None:
    check_against_hf([{"temperature": 0.0, "repetition_penalty": p, "out": 5}
                      for p in (1.0, 1.3, 0.7, 2.0, 1.05)])


@pytest.mark.usefixtures("threshold_strategy")
def test_min_new_tokens_matches_hf() -> None:
    rows = [{"temperature": 0.0, "min_new_tokens": m, "stop": s, "out": o}
            for m, s, o in [(5, (2,), 3), (5, (2, 9), 5), (5, (2, 9), 4), (3, (7, 7, 11), 0),
                            (0, (2,), 0), (4, (), 1), (9, (399,), 8)]]
    check_against_hf(rows)


@pytest.mark.usefixtures("threshold_strategy")
def test_length_penalty_matches_hf() -> None:
    rows = [{"temperature": 0.0, "lp_start": s, "lp_decay": d, "stop": stop, "out": o}
            for s, d, stop, o in [(2, 1.5, (3,), 5), (2, 1.5, (3, 8), 2), (0, 0.8, (3, 8), 4),
                                  (1, 1.2, (5, 5), 10), (4, 1.0, (3,), 9), (0, 2.0, (), 3)]]
    # Combined with min_new_tokens the penalty must leave the masked -inf alone (HF order).
    rows.append({"temperature": 0.0, "lp_start": 1, "lp_decay": 1.4, "stop": (3, 8),
                 "min_new_tokens": 6, "out": 4})
    check_against_hf(rows)


@pytest.mark.parametrize("max_top_k", [None, 60])
@pytest.mark.usefixtures("threshold_strategy")
def test_top_k_matches_hf(max_top_k: int | None) -> None:
    ks = (1, 2, 7, 33, 60)
    temps = (1.0, 0.5, 1.3, 2, 1)
    check_against_hf([{"top_k": k, "temperature": t} for k, t in zip(ks, temps, strict=True)],
                     max_top_k=max_top_k)


@pytest.mark.usefixtures("threshold_strategy")
def test_top_k_keeps_exactly_k() -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3))
    ks = [1, 5, 50, 999, 1000]
    st, hints = make_rows([{"top_k": k} for k in ks])
    out = Sampler().warped_logits(logits, SamplingBatch(st, hints=hints), torch.zeros(5,
                                                                                      dtype=torch.int32))
    assert torch.isfinite(out).sum(1).tolist() == ks


@pytest.mark.usefixtures("threshold_strategy")
def test_top_p_matches_hf() -> None:
    ps = (0.0, 0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0)
    check_against_hf([{"top_p": p} for p in ps])
    check_against_hf([{"top_p": p, "temperature": 0.6} for p in ps], scale=1.0, seed=1)


@pytest.mark.usefixtures("threshold_strategy")
def test_typical_matches_hf() -> None:
    ts = (0.05, 0.2, 0.5, 0.9, 0.99, 1.0)
    check_against_hf([{"typical_p": t} for t in ts])
    check_against_hf([{"typical_p": t, "temperature": 1.7} for t in ts], scale=1.0, seed=2)


@pytest.mark.usefixtures("threshold_strategy")
def test_min_p_matches_hf() -> None:
    ms = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)
    check_against_hf([{"min_p": m} for m in ms])
    check_against_hf([{"min_p": m, "temperature": 0.7} for m in ms], scale=1.0, seed=4)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.usefixtures("threshold_strategy")
def test_mixed_rows_match_hf(seed: int) -> None:
    check_against_hf(MIXED_ROWS, seed=seed)


@pytest.mark.usefixtures("threshold_strategy")
def test_hints_skip_only_unused_work() -> None:
    """Tight hints and the all-True defaults give the same scores."""
    rng = torch.Generator().manual_seed(5)
    rows = [{"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.0}, {"temperature": 1.1}]
    st, hints = make_rows(rows)
    assert hints == SamplerHints(any_greedy=True, any_top_k=False, any_top_p=True, any_min_p=False,
                                 any_typical=False, max_top_k=0, any_min_new_tokens=False,
                                 any_length_penalty=False)
    logits = torch.randn(3, 300, generator=rng)
    oc = torch.zeros(3, dtype=torch.int32)
    s = Sampler()
    torch.testing.assert_close(s.warped_logits(logits, SamplingBatch(st, hints=hints), oc),
                               s.warped_logits(logits, SamplingBatch(st), oc), rtol=0, atol=0)


def test_hints_from_params_objects() -> None:
    from tandem_serve.proto.request_params import SamplingParams

    params = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=50, typical_p=0.5, min_new_tokens=3)]
    assert SamplerHints.from_params(params) == SamplerHints(
        any_greedy=True, any_top_k=True, any_top_p=False, any_min_p=False, any_typical=True,
        max_top_k=50, any_min_new_tokens=True, any_length_penalty=False)
    assert SamplerHints.from_params([SamplingParams(temperature=0.5),
                                     SamplingParams(temperature=0.5, top_k=5)]).max_top_k == 0


def test_half_precision_and_strided_logits() -> None:
    rows = [{k: v for k, v in r.items() if k != "out"} for r in MIXED_ROWS]
    st, hints = make_rows([{**r, "seed": i} for i, r in enumerate(rows)])
    base = torch.randn(300, len(rows), generator=torch.Generator().manual_seed(9))
    oc = torch.zeros(len(rows), dtype=torch.int32)
    ref = Sampler()(base.t().contiguous(), SamplingBatch(st, hints=hints, need_logprobs=True,
                                                         max_top_n=2), oc)
    strided = Sampler()(base.t(), SamplingBatch(st, hints=hints, need_logprobs=True, max_top_n=2),
                        oc)
    assert torch.equal(ref.token_ids, strided.token_ids)
    half = Sampler()(base.t().to(torch.bfloat16),
                     SamplingBatch(st, hints=hints, need_logprobs=True, max_top_n=2), oc)
    assert half.token_ids.shape == (len(rows),) and half.logprobs is not None
    assert half.logprobs.dtype == torch.float32


def test_logits_not_modified_unless_inplace() -> None:
    logits = torch.randn(len(MIXED_ROWS), 100)
    before = logits.clone()
    st, _ = make_rows(MIXED_ROWS)
    seen = torch.rand(len(MIXED_ROWS), 100) < 0.2
    Sampler()(logits, SamplingBatch(st, seen=seen, any_penalty=True, need_logprobs=True,
                                    max_top_n=3), torch.full((len(MIXED_ROWS),), 3,
                                                             dtype=torch.int32))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- greedy


def test_temperature_zero_is_argmax_of_processed_logits() -> None:
    rng = torch.Generator().manual_seed(7)
    vocab, prompt_len = 500, DEFAULTS["prompt_len"]
    rows = [{"temperature": 0.0, "repetition_penalty": p, "min_new_tokens": m, "stop": (1, 2),
             "lp_start": 0, "lp_decay": d, "out": 3} for p, m, d in
            [(1.0, 0, 1.0), (1.4, 5, 1.0), (0.8, 0, 1.5), (1.1, 2, 1.2)]]
    logits = torch.randn(len(rows), vocab, generator=rng) * 4
    # Make the stop ids the argmax so min_new_tokens and the length penalty matter.
    logits[:, 1] = 20.0
    hist = history(rng, len(rows), prompt_len, [3] * len(rows), vocab)
    st, hints = make_rows([{k: v for k, v in r.items() if k != "out"} for r in rows])
    oc = torch.full((len(rows),), 3, dtype=torch.int32)
    out = Sampler()(logits, SamplingBatch(st, hints=hints, seen=seen_mask(hist, vocab),
                                          all_greedy=True, any_penalty=True), oc)
    expected = hf_reference(logits, rows, hist, prompt_len).argmax(1)
    assert torch.equal(out.token_ids, expected)
    # The all_greedy shortcut and the general path agree.
    out2 = Sampler()(logits, SamplingBatch(st, seen=seen_mask(hist, vocab), any_penalty=True), oc)
    assert torch.equal(out2.token_ids, expected)


def test_greedy_rows_unaffected_by_sampled_rows() -> None:
    rng = torch.Generator().manual_seed(8)
    vocab = 1000
    greedy = [{"temperature": 0.0, "repetition_penalty": 1.2}, {"temperature": 0.0}]
    others = MIXED_ROWS[2:]
    logits = torch.randn(len(greedy) + len(others), vocab, generator=rng)
    seen = torch.rand(logits.shape, generator=rng) < 0.1
    oc = torch.full((logits.shape[0],), 2, dtype=torch.int32)
    st_g, h_g = make_rows(greedy)
    alone = Sampler()(logits[:2], SamplingBatch(st_g, hints=h_g, seen=seen[:2], all_greedy=True,
                                                any_penalty=True), oc[:2])
    st_m, h_m = make_rows([{k: v for k, v in r.items() if k != "out"}
                           for r in greedy + others])
    mixed = Sampler()(logits, SamplingBatch(st_m, hints=h_m, seen=seen, any_penalty=True), oc)
    assert torch.equal(mixed.token_ids[:2], alone.token_ids)
