"""Helpers for the sampler tests: rows of sampling parameters as tensors, the processors HF
generate() builds for them, and a fixture running a test with each threshold strategy.
"""
from __future__ import annotations

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

import tandem_serve.gpu_worker.sampling.sampler as sampler_mod
from tandem_serve.gpu_worker.sampling.sampler import (
    Sampler,
    SamplerHints,
    SamplingBatch,
    SamplingTensors,
)

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
    rows_in = SamplingBatch(st, hints=hints, seen=seen_mask(hist, vocab), any_penalty=True)
    mine = Sampler().warped_logits(logits, rows_in, oc)
    ref = hf_reference(logits, rows, hist, prompt_len)
    kept, ref_kept = torch.isfinite(mine), torch.isfinite(ref)
    for i in range(len(rows)):
        assert torch.equal(kept[i], ref_kept[i]), (
            f"row {i} {rows[i]}: {int(kept[i].sum())} kept vs HF {int(ref_kept[i].sum())}")
    torch.testing.assert_close(mine[kept], ref[kept], rtol=1e-6, atol=1e-6)


@pytest.fixture(params=["sort", "radix"])
def threshold_strategy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with both exact threshold strategies (sorted narrow domain, radix)."""
    monkeypatch.setattr(sampler_mod, "_SORT_MAX_WIDTH",
                        1 << 30 if request.param == "sort" else 0)
    return str(request.param)


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
