"""oneDNN-packed linears see a bounded set of row counts, whatever the batch shapes.

oneDNN keeps a JIT-compiled primitive (about half a MB) per input shape; unbounded shapes made
the gpu worker's RSS grow for as long as new prefill lengths and batch sizes turned up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.models.layers import (
    ONEDNN_MAX_ROWS,
    linear,
    onednn_fp32_usable,
    onednn_rows,
    pack_linear,
)
from tandem_serve.gpu_worker.models.loader import load_model
from tests.gpu_worker.model_utils import PagedDriver, make_tiny_checkpoint, random_prompts

needs_onednn = pytest.mark.skipif(not onednn_fp32_usable(), reason="no fp32 oneDNN here")


def test_onednn_rows_bounded_and_tight() -> None:
    rows = [onednn_rows(m) for m in range(1, 4097)]
    for m, r in enumerate(rows, start=1):
        assert m <= r <= m + m // 8, m  # at most 12.5% padding rows
    assert rows == sorted(rows)
    assert all(onednn_rows(m) == m for m in [*range(1, 17), 32, 64, 128, 1024, 2048])
    # 16 exact sizes, then 8 per octave: 16 + 8 * 7 up to 2048, 8 more per doubling.
    assert len(set(rows[:2048])) == 72
    assert len(set(rows)) == 80


@needs_onednn
def test_packed_linear_pads_rows_and_matches_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    op = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        out: torch.Tensor = op(x, *args)
        return out

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g)
    packed = pack_linear(w)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for m in (1, 16, 17, 33, 100, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 300):
        calls = len(seen)
        x = torch.randn(m, 32, generator=g)
        out = linear(x, w, b, packed)
        assert out.shape == (m, 48)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        if m <= ONEDNN_MAX_ROWS:
            assert seen[calls:] == [onednn_rows(m)]
        else:  # MKL: no oneDNN primitive for a new large shape
            assert len(seen) == calls


@needs_onednn
def test_model_forwards_use_bucketed_shapes_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefills of every length 1..200 (and two longer) and decode batches of 1..40 rows: the
    packed op only ever sees bucket sizes up to ONEDNN_MAX_ROWS, far fewer than the distinct
    row counts."""
    path = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    model = load_model(path, torch.float32, torch.device("cpu"))
    seen: set[int] = set()
    op = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.add(x.shape[0])
        out: torch.Tensor = op(x, *args)
        return out

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    lengths = [*range(1, 201), 300, 517]
    driver = PagedDriver(model, num_blocks=2000, block_size=16)
    seqs = [driver.new_seq(p) for p in random_prompts(lengths, model.config.vocab_size, seed=1)]
    for s, n in zip(seqs, lengths, strict=True):
        driver.append_greedy([s], driver.prefill([(s, n)]), 1000)
    for batch in range(1, 41):
        driver.append_greedy(seqs[:batch], driver.decode(seqs[:batch]), 1000)
    buckets = {onednn_rows(m) for m in range(1, ONEDNN_MAX_ROWS + 1)}
    assert seen <= buckets
    assert len(seen) < len(lengths) // 3


@needs_onednn
def test_no_onednn_keeps_plain_linear_with_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--no-onednn: no packed weights, the oneDNN op is never called, same logits."""
    path = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    packed = load_model(path, torch.float32, torch.device("cpu"))
    plain = load_model(path, torch.float32, torch.device("cpu"), onednn=False)
    assert packed._packed_lm_head is not None and plain._packed_lm_head is None
    prompts = random_prompts([7, 19], plain.config.vocab_size, seed=3)

    def logits(model: torch.nn.Module) -> torch.Tensor:
        driver = PagedDriver(model, num_blocks=64, block_size=16)
        seqs = [driver.new_seq(p) for p in prompts]
        return driver.prefill([(s, len(p)) for s, p in zip(seqs, prompts, strict=True)])

    want = logits(packed)
    calls = 0
    op = torch.ops.mkldnn._linear_pointwise

    def spy(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        out: torch.Tensor = op(*args)
        return out

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    got = logits(plain)
    assert calls == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_worker_config_reaches_the_model(tmp_path: Path) -> None:
    from tandem_serve.gpu_worker.build import build_runner
    from tandem_serve.proto.config import ServerConfig

    path = make_tiny_checkpoint(tmp_path, "llama", tokenizer=False)
    cfg = ServerConfig(model=path, device="cpu", num_kv_blocks=8, max_num_seqs=2,
                       onednn=False, flash_attn=False, attention_backend="flex",
                       enforce_eager=True)
    runner = build_runner(cfg)
    assert runner.model._packed_lm_head is None
    assert runner.attention.name == "flex" and runner.model.attention is runner.attention
    assert runner.graphs is None
