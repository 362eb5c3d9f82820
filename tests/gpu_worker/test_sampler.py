"""The batched sampler against Hugging Face's logits processors, plus seeding and logprobs."""
from __future__ import annotations

import itertools
from typing import Any, cast

import pytest
import torch
from torch import Tensor
from transformers.generation.logits_process import (
    ExponentialDecayLengthPenalty,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import gpu_worker.sampler as sampler_mod
from gpu_worker.sampler import (
    Sampler,
    SamplerHints,
    SamplerOutput,
    SamplingTensors,
    row_keys,
    row_uniform,
)
from gpu_worker.sync_guard import forbid_host_sync


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    # The tensors here are tiny; on a shared 2-core box intra-op threads only add barrier waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


DEFAULTS: dict[str, Any] = dict(
    temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0, min_p=0.0, repetition_penalty=1.0,
    seed=0, min_new_tokens=0, stop=(), lp_start=0, lp_decay=1.0, prompt_len=4,
)


def make_rows(rows: list[dict[str, Any]]) -> tuple[SamplingTensors, SamplerHints]:
    """Device tensors and the tightest host hints for rows given as parameter overrides."""
    full = [{**DEFAULTS, **r} for r in rows]

    def col(name: str, dtype: torch.dtype) -> Tensor:
        return torch.tensor([r[name] for r in full], dtype=dtype)

    width = max(1, max(len(r["stop"]) for r in full))
    stops = torch.full((len(full), width), -1, dtype=torch.int64)
    for i, r in enumerate(full):
        stops[i, : len(r["stop"])] = torch.tensor(r["stop"], dtype=torch.int64)
    st = SamplingTensors(
        temperature=col("temperature", torch.float32), top_k=col("top_k", torch.int32),
        top_p=col("top_p", torch.float32), typical_p=col("typical_p", torch.float32),
        min_p=col("min_p", torch.float32),
        repetition_penalty=col("repetition_penalty", torch.float32),
        seed=col("seed", torch.int64), min_new_tokens=col("min_new_tokens", torch.int32),
        stop_token_ids=stops, lp_start=col("lp_start", torch.int32),
        lp_decay=col("lp_decay", torch.float32), prompt_len=col("prompt_len", torch.int32))
    hints = SamplerHints.for_rows(
        [r["temperature"] for r in full], [r["top_k"] for r in full],
        [r["top_p"] for r in full], [r["typical_p"] for r in full],
        [r["min_p"] for r in full], [r["min_new_tokens"] for r in full],
        [r["lp_decay"] for r in full])
    return st, hints


def hf_processors(r: dict[str, Any], prompt_len: int) -> LogitsProcessorList:
    """The processors HF generate() builds for one row's parameters, in its order."""
    r = {**DEFAULTS, **r}
    procs = LogitsProcessorList()
    if r["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(r["repetition_penalty"])))
    if r["min_new_tokens"] > 0 and r["stop"]:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, r["min_new_tokens"],
                                                       list(r["stop"])))
    if r["lp_decay"] != 1.0 and r["stop"]:
        procs.append(ExponentialDecayLengthPenalty((r["lp_start"], float(r["lp_decay"])),
                                                   list(r["stop"]), prompt_len))
    if r["temperature"] > 0:
        if r["temperature"] != 1.0:
            procs.append(TemperatureLogitsWarper(float(r["temperature"])))
        if r["top_k"] > 0:
            procs.append(TopKLogitsWarper(int(r["top_k"])))
        if r["top_p"] < 1.0:
            procs.append(TopPLogitsWarper(float(r["top_p"])))
        procs.append(MinPLogitsWarper(float(r["min_p"])))
        if 0.0 < r["typical_p"] < 1.0:
            procs.append(TypicalLogitsWarper(float(r["typical_p"])))
    return procs


def history(rng: torch.Generator, rows: int, prompt_len: int, out: list[int],
            vocab: int) -> list[Tensor]:
    return [torch.randint(0, vocab, (prompt_len + out[i],), generator=rng) for i in range(rows)]


def seen_mask(hist: list[Tensor], vocab: int) -> Tensor:
    seen = torch.zeros(len(hist), vocab, dtype=torch.bool)
    for i, h in enumerate(hist):
        seen[i, h] = True
    return seen


def hf_reference(logits: Tensor, rows: list[dict[str, Any]], hist: list[Tensor],
                 prompt_len: int) -> Tensor:
    return torch.cat([hf_processors(r, prompt_len)(long_ids(hist[i].unsqueeze(0)),
                                                    logits[i: i + 1])
                      for i, r in enumerate(rows)])


def long_ids(t: Tensor) -> torch.LongTensor:
    return cast(torch.LongTensor, t)


NO_IDS = long_ids(torch.zeros(1, 1, dtype=torch.long))  # warpers ignore input_ids


def check_against_hf(rows: list[dict[str, Any]], vocab: int = 400, seed: int = 0,
                     scale: float = 3.0, max_top_k: int | None = None) -> None:
    rng = torch.Generator().manual_seed(seed)
    prompt_len = DEFAULTS["prompt_len"]
    out_count = [int(r.get("out", 3)) for r in rows]
    logits = torch.randn(len(rows), vocab, generator=rng) * scale
    hist = history(rng, len(rows), prompt_len, out_count, vocab)
    st, hints = make_rows([{k: v for k, v in r.items() if k != "out"} for r in rows])
    if max_top_k is not None:
        hints = SamplerHints(max_top_k=max_top_k)
    oc = torch.tensor(out_count, dtype=torch.int32)
    mine = Sampler().warped_logits(logits, st, seen_mask(hist, vocab), oc, any_penalty=True,
                                   hints=hints)
    ref = hf_reference(logits, rows, hist, prompt_len)
    kept, ref_kept = torch.isfinite(mine), torch.isfinite(ref)
    for i in range(len(rows)):
        assert torch.equal(kept[i], ref_kept[i]), (
            f"row {i} {rows[i]}: {int(kept[i].sum())} kept vs HF {int(ref_kept[i].sum())}")
    torch.testing.assert_close(mine[kept], ref[kept], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- processors vs HF


@pytest.fixture(params=["sort", "radix"])
def threshold_strategy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with both exact threshold strategies (sorted narrow domain, radix)."""
    monkeypatch.setattr(sampler_mod, "_SORT_MAX_WIDTH",
                        1 << 30 if request.param == "sort" else 0)
    return str(request.param)


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
    out = Sampler().warped_logits(logits, st, None, torch.zeros(5, dtype=torch.int32), False,
                                  hints=hints)
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


MIXED_ROWS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.3, "min_new_tokens": 4, "stop": (2,)},
    {"temperature": 0.8},
    {"temperature": 0.8, "top_k": 20},
    {"temperature": 1.2, "top_p": 0.8},
    {"temperature": 1.0, "typical_p": 0.7},
    {"temperature": 0.5, "min_p": 0.05},
    {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "min_p": 0.02, "typical_p": 0.95,
     "repetition_penalty": 1.2, "min_new_tokens": 2, "stop": (2, 5), "lp_start": 1,
     "lp_decay": 1.3, "out": 6},
    {"temperature": 1.5, "top_k": 5, "top_p": 0.5},
    {"temperature": 0.7, "top_p": 0.9, "typical_p": 0.5, "repetition_penalty": 0.9},
]


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
    torch.testing.assert_close(s.warped_logits(logits, st, None, oc, False, hints=hints),
                               s.warped_logits(logits, st, None, oc, False), rtol=0, atol=0)


def test_hints_from_params_objects() -> None:
    from proto.messages import SamplingParams

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
    ref = Sampler()(base.t().contiguous(), st, None, oc, False, False, True, 2, hints=hints)
    strided = Sampler()(base.t(), st, None, oc, False, False, True, 2, hints=hints)
    assert torch.equal(ref.token_ids, strided.token_ids)
    half = Sampler()(base.t().to(torch.bfloat16), st, None, oc, False, False, True, 2,
                     hints=hints)
    assert half.token_ids.shape == (len(rows),) and half.logprobs is not None
    assert half.logprobs.dtype == torch.float32


def test_logits_not_modified_unless_inplace() -> None:
    logits = torch.randn(len(MIXED_ROWS), 100)
    before = logits.clone()
    st, _ = make_rows(MIXED_ROWS)
    seen = torch.rand(len(MIXED_ROWS), 100) < 0.2
    Sampler()(logits, st, seen, torch.full((len(MIXED_ROWS),), 3, dtype=torch.int32),
              all_greedy=False, any_penalty=True, need_logprobs=True, max_top_n=3)
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
    out = Sampler()(logits, st, seen_mask(hist, vocab), oc, all_greedy=True, any_penalty=True,
                    need_logprobs=False, max_top_n=0, hints=hints)
    expected = hf_reference(logits, rows, hist, prompt_len).argmax(1)
    assert torch.equal(out.token_ids, expected)
    # The all_greedy shortcut and the general path agree.
    out2 = Sampler()(logits, st, seen_mask(hist, vocab), oc, all_greedy=False,
                     any_penalty=True, need_logprobs=False, max_top_n=0)
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
    alone = Sampler()(logits[:2], st_g, seen[:2], oc[:2], all_greedy=True, any_penalty=True,
                      need_logprobs=False, max_top_n=0, hints=h_g)
    st_m, h_m = make_rows([{k: v for k, v in r.items() if k != "out"}
                           for r in greedy + others])
    mixed = Sampler()(logits, st_m, seen, oc, all_greedy=False, any_penalty=True,
                      need_logprobs=False, max_top_n=0, hints=h_m)
    assert torch.equal(mixed.token_ids[:2], alone.token_ids)


# ---------------------------------------------------------------- seeding


def _splitmix_ref(state: int) -> int:
    m = (1 << 64) - 1
    z = state & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_hash_is_splitmix64_with_wraparound() -> None:
    golden, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    seeds = [0, 1, 12345, (1 << 63) - 1, 987654321987654321]
    counts = [0, 1, 7, 100000, 3]
    keys = row_keys(torch.tensor(seeds), torch.tensor(counts, dtype=torch.int32))
    u = row_uniform(torch.tensor(seeds), torch.tensor(counts, dtype=torch.int32))
    for i, (s, c) in enumerate(zip(seeds, counts, strict=True)):
        key = _splitmix_ref(_splitmix_ref(s + golden) + (c + 1) * golden)
        assert int(keys[i]) & m == key
        assert float(u[i]) == (key >> 11) * 2.0**-53
    assert ((u >= 0) & (u < 1)).all()


def fake_model(vocab: int, seed: int = 11) -> Tensor:
    """A next-token logits table: logits of step t = table[previous token]."""
    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def run_steps(table: Tensor, rows: list[dict[str, Any]], first: Tensor, steps: int,
              prompt: list[Tensor], tight_hints: bool = True) -> Tensor:
    """Decode ``steps`` tokens on the device, feeding sampled ids back without host reads."""
    vocab = table.shape[0]
    st, hints = make_rows(rows)
    if not tight_hints:
        hints = SamplerHints()
    seen = seen_mask(prompt, vocab)
    oc = torch.zeros(len(rows), dtype=torch.int32)
    any_penalty = any(r.get("repetition_penalty", 1.0) != 1.0 for r in rows)
    all_greedy = all(r.get("temperature", 1.0) == 0 for r in rows)
    sampler, tok, out = Sampler(), first, []
    with forbid_host_sync():
        for _ in range(steps):
            res = sampler(table[tok], st, seen, oc, all_greedy, any_penalty,
                          need_logprobs=True, max_top_n=2, hints=hints)
            tok = res.token_ids
            seen.scatter_(1, tok.unsqueeze(1), True)
            oc += 1
            out.append(tok)
    return torch.stack(out, 1)


SEEDED: list[dict[str, Any]] = [
    {"temperature": 0.9, "seed": 1234, "repetition_penalty": 1.1},
    {"temperature": 1.3, "seed": 99, "top_k": 40, "top_p": 0.9},
    {"temperature": 0.7, "seed": 7, "typical_p": 0.8, "min_p": 0.05, "stop": (3,),
     "min_new_tokens": 4, "lp_start": 5, "lp_decay": 1.3},
]


@pytest.mark.parametrize("target", range(len(SEEDED)))
def test_seeded_row_is_batch_invariant(target: int) -> None:
    vocab, steps = 800, 20
    table = fake_model(vocab)
    rng = torch.Generator().manual_seed(target)
    others: list[dict[str, Any]] = [
        {**{k: v for k, v in r.items() if k != "out"}, "seed": 1000 + i}
        for i, r in enumerate(MIXED_ROWS * 2)][:16]
    row = SEEDED[target]
    prompt = history(rng, 17, 6, [0] * 17, vocab)
    first = torch.randint(0, vocab, (17,), generator=rng)
    alone = run_steps(table, [row], first[9:10], steps, prompt[9:10])
    batch = others[:9] + [row] + others[9:]
    inside = run_steps(table, batch, first, steps, prompt)
    assert torch.equal(inside[9], alone[0])
    # Default (untight) hints take other code paths; the tokens must not change.
    assert torch.equal(run_steps(table, [row], first[9:10], steps, prompt[9:10], False), alone)
    # Another slot, reversed neighbours.
    batch2 = others[::-1][:3] + [row] + others[::-1][3:]
    assert torch.equal(run_steps(table, batch2, first[[*range(3), 9, *range(3, 16)]], steps,
                                 [prompt[i] for i in [*range(3), 9, *range(3, 16)]])[3],
                       alone[0])
    # Different steps draw independently: a seeded row does not repeat one token forever.
    assert len(set(alone[0].tolist())) > 3


def test_same_seed_same_step_same_token_and_seeds_differ() -> None:
    logits = torch.zeros(64, 1000)  # flat: the row's uniform alone picks the token
    st, hints = make_rows([{"seed": 5}] * 32 + [{"seed": s} for s in range(32)])
    oc = torch.zeros(64, dtype=torch.int32)
    tok = Sampler()(logits, st, None, oc, False, False, False, 0, hints=hints).token_ids
    assert len(set(tok[:32].tolist())) == 1
    assert len(set(tok[32:].tolist())) > 25


# ---------------------------------------------------------------- distribution


def chi_square(tokens: Tensor, probs: Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 1e-4 for 3..7 degrees of freedom
CHI2_1E4 = {3: 21.1, 4: 23.5, 5: 25.7, 6: 27.9, 7: 29.9}


@pytest.mark.parametrize("over", ["seeds", "steps"])
def test_sampling_frequencies_match_softmax(over: str) -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    temp, n = 0.7, 20000
    logits = base.expand(n, -1).contiguous()
    if over == "seeds":
        st, hints = make_rows([{"temperature": temp, "seed": s} for s in range(n)])
        oc = torch.zeros(n, dtype=torch.int32)
    else:
        st, hints = make_rows([{"temperature": temp, "seed": 42}] * n)
        oc = torch.arange(n, dtype=torch.int32)
    tok = Sampler()(logits, st, None, oc, False, False, False, 0, hints=hints).token_ids
    assert chi_square(tok, torch.softmax(base / temp, 0)) < CHI2_1E4[7]


@pytest.mark.parametrize("params", [{"top_k": 3}, {"top_p": 0.8}, {"top_k": 5, "top_p": 0.7},
                                    {"typical_p": 0.6}, {"min_p": 0.2}])
def test_truncated_sampling_frequencies(params: dict[str, Any]) -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    temp, n = 0.9, 20000
    rows = [{"temperature": temp, "seed": s, **params} for s in range(n)]
    st, hints = make_rows(rows)
    logits = base.expand(n, -1).contiguous()
    tok = Sampler()(logits, st, None, torch.zeros(n, dtype=torch.int32), False, False, False,
                    0, hints=hints).token_ids
    ref = hf_processors(rows[0], 0)(NO_IDS, base.unsqueeze(0))[0]
    probs = torch.softmax(ref, 0)
    dof = int((probs > 0).sum()) - 1
    if dof == 0:
        assert (tok == probs.argmax()).all()
    else:
        assert chi_square(tok, probs) < CHI2_1E4.get(dof, 21.1 if dof < 3 else 30.0)


@pytest.mark.usefixtures("threshold_strategy")
def test_truncation_never_picks_a_removed_token() -> None:
    vocab, n = 2000, 512
    rng = torch.Generator().manual_seed(12)
    logits = (torch.randn(1, vocab, generator=rng) * 2).expand(n, -1).contiguous()
    for params in ({"top_k": 10}, {"top_p": 0.3}, {"top_k": 40, "top_p": 0.6},
                   {"typical_p": 0.4}, {"min_p": 0.3}):
        rows = [{"temperature": 1.5, "seed": s, **params} for s in range(n)]
        st, hints = make_rows(rows)
        tok = Sampler()(logits, st, None, torch.zeros(n, dtype=torch.int32), False, False,
                        False, 0, hints=hints).token_ids
        ref = hf_processors(rows[0], 0)(NO_IDS, logits[:1])[0]
        allowed = torch.isfinite(ref)
        assert allowed[tok].all(), params
        assert len(set(tok.tolist())) > 1, params


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
    out = Sampler()(logits, st, seen_mask(hist, vocab), oc, False, True, True, 5, hints=hints)
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
    out = Sampler()(logits, st, None, torch.zeros(6, dtype=torch.int32), True, False, True, 4,
                    hints=hints)
    check_logprobs(out, torch.log_softmax(logits, 1), 4)
    assert out.ranks is not None and bool((out.ranks == 1).all())
    none = Sampler()(logits, st, None, torch.zeros(6, dtype=torch.int32), True, False, False, 0)
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
        out = sampler(logits, st, seen if any_penalty else None, oc, all_greedy, any_penalty,
                      need_logprobs, max_top_n, hints=hints if tight else None)
        sampler.warped_logits(logits, st, seen, oc, True, hints=hints if tight else None)
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
        out = Sampler()(logits, st, None, torch.zeros(4, dtype=torch.int32), False, False,
                        True, 2, hints=hints, inplace=True)
    assert out.token_ids.shape == (4,)
