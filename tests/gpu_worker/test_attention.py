"""Paged attention (the SDPA backend) against a dense causal reference (float32, 1e-5), cache
writes, GQA; with an fp8 cache, against the reference over the k/v as fp8 holds them (the
same 1e-5)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import (
    FP8,
    KVCache,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    resolve_kv_dtype,
)
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend

ATOL = 1e-5
KV_DTYPES = [torch.float32, FP8]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
           meta: AttentionMetadata, scale: float, window: int | None = None,
           backend: AttentionBackend | None = None) -> torch.Tensor:
    """One layer's attention as the model runs it: the backend's plan for the forward (SDPA
    unless given), then its call, which writes k/v and attends."""
    backend = backend or SdpaBackend()
    plan = backend.prepare(meta, cache, (window,))
    return backend.forward(q, k, v, cache, plan, scale, window)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache gives back for x: scale 1.0, saturated at ±448 (written by hand, not
    with the code under test)."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)


def dense_reference(
    q: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor, scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq positions of a context with k/v history [L, Hkv, D]."""
    lq, hq, _ = q.shape
    length, hkv, _ = k_hist.shape
    g = hq // hkv
    k = k_hist.double().repeat_interleave(g, dim=1)
    v = v_hist.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - lq, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@dataclass
class Seq:
    k: torch.Tensor  # full history [L, Hkv, D]
    v: torch.Tensor
    q: torch.Tensor  # queries for the last q_len positions [q_len, Hq, D]
    blocks: list[int]


class Scenario:
    """Random sequences laid out in a paged cache with shuffled block ids.

    The cache starts filled with random values (not zeros) so stray writes are detectable; each
    sequence's history before its query tokens is written directly, as earlier forwards would.
    """

    def __init__(self, hq: int, hkv: int, d: int, block_size: int, num_blocks: int = 64,
                 seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.hq, self.hkv, self.d, self.bs = hq, hkv, d, block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cpu")[0]
        self.cache[0].copy_(torch.randn(self.cache[0].shape, generator=self.gen))
        self.cache[1].copy_(torch.randn(self.cache[1].shape, generator=self.gen))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: list[Seq] = []

    def add(self, ctx_len: int, q_len: int) -> Seq:
        g = self.gen
        k = torch.randn(ctx_len, self.hkv, self.d, generator=g)
        v = torch.randn(ctx_len, self.hkv, self.d, generator=g)
        q = torch.randn(q_len, self.hq, self.d, generator=g)
        blocks = [self.free.pop() for _ in range(-(-ctx_len // self.bs))]
        seq = Seq(k, v, q, blocks)
        for p in range(ctx_len - q_len):
            b, o = blocks[p // self.bs], p % self.bs
            self.cache[0][b, o] = k[p]
            self.cache[1][b, o] = v[p]
        self.seqs.append(seq)
        return seq

    def slot(self, seq: Seq, p: int) -> int:
        return seq.blocks[p // self.bs] * self.bs + p % self.bs

    def block_tables(self, seqs: Sequence[Seq | None], pad: int = -1) -> torch.Tensor:
        width = max(len(s.blocks) for s in seqs if s is not None) + 2
        rows = [s.blocks if s is not None else [] for s in seqs]
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int32)

    def reference(self, s: Seq, scale: float, window: int | None) -> torch.Tensor:
        """The dense reference over the history as the cache holds it."""
        if self.cache[0].dtype != FP8:
            return dense_reference(s.q, s.k, s.v, scale, window)
        return dense_reference(s.q, fp8_round_trip(s.k), fp8_round_trip(s.v), scale, window)


@pytest.mark.parametrize(
    "hq,hkv,block_size", [(4, 2, 16), (4, 1, 8), (8, 8, 16), (6, 2, 4)]
)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_matches_dense_and_masked_rows_touch_nothing(
    hq: int, hkv: int, block_size: int, window: int | None, kv_dtype: torch.dtype
) -> None:
    d = 32
    sc = Scenario(hq, hkv, d, block_size, seed=hq * 100 + hkv, dtype=kv_dtype)
    ctx_lens = [1, block_size, block_size + 1, 40, 100]
    real = [sc.add(n, 1) for n in ctx_lens]
    # Masked rows interleaved: one with seq_len 0, one with a stale length and real blocks.
    rows: list[Seq | None] = [real[0], None, real[1], real[2], None, real[3], real[4]]
    stale = {4: real[3]}
    slot_mapping, seq_lens, q, k, v = [], [], [], [], []
    for i, s in enumerate(rows):
        if s is None:
            slot_mapping.append(-1)
            seq_lens.append(len(stale[i].k) if i in stale else 0)
            q.append(torch.randn(hq, d, generator=sc.gen) * 50)
            k.append(torch.full((hkv, d), 1e4))  # would be obvious if it landed in a block
            v.append(torch.full((hkv, d), -1e4))
        else:
            n = len(s.k)
            slot_mapping.append(sc.slot(s, n - 1))
            seq_lens.append(n)
            q.append(s.q[0])
            k.append(s.k[n - 1])
            v.append(s.v[n - 1])
    table_rows = [s if s is not None else stale.get(i) for i, s in enumerate(rows)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        block_tables=sc.block_tables(table_rows),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=None,
        query_lens=None,
        max_seq_len=max(seq_lens) + 7,  # an upper bound, not the exact max
        is_decode=True,
    )
    before = [c.clone() for c in sc.cache]
    scale = d**-0.5
    out = attend(torch.stack(q), torch.stack(k), torch.stack(v), sc.cache, meta, scale, window)
    assert out.shape == (len(rows), hq, d)
    assert torch.isfinite(out).all()
    for i, s in enumerate(rows):
        if s is None:
            continue
        ref = sc.reference(s, scale, window)
        torch.testing.assert_close(out[i], ref[0], atol=ATOL, rtol=0)
    # Exactly the real rows' slots changed; the scratch block (last) is the only other change.
    expected = [c.clone() for c in before]
    for s in real:
        n = len(s.k)
        b, o = s.blocks[(n - 1) // block_size], (n - 1) % block_size
        expected[0][b, o] = s.k[n - 1]
        expected[1][b, o] = s.v[n - 1]
    for c, e in zip(sc.cache, expected, strict=True):
        assert torch.equal(c[:-1], e[:-1])


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1), (8, 8)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_matches_dense_with_prefix_chunks_and_padding(
    hq: int, hkv: int, window: int | None, kv_dtype: torch.dtype
) -> None:
    d, bs = 16, 16
    sc = Scenario(hq, hkv, d, bs, num_blocks=96, seed=7 + hq + hkv, dtype=kv_dtype)
    # (context length after this forward, query length): fresh prompts, a 1-token prompt,
    # and chunks whose earlier part (or shared prefix) is already cached.
    shapes = [(33, 33), (1, 1), (100, 30), (64, 16), (17, 1), (300, 300)]
    seqs = [sc.add(n, ql) for n, ql in shapes]
    q_parts, k_parts, v_parts, slots, q_lens = [], [], [], [], []
    for s, (n, ql) in zip(seqs, shapes, strict=True):
        q_parts.append(s.q)
        k_parts.append(s.k[n - ql:])
        v_parts.append(s.v[n - ql:])
        slots += [sc.slot(s, p) for p in range(n - ql, n)]
        q_lens.append(ql)
    n_pad = 3  # trailing padding tokens (slot -1) beyond the last sequence
    q_parts.append(torch.randn(n_pad, hq, d, generator=sc.gen))
    k_parts.append(torch.full((n_pad, hkv, d), 1e4))
    v_parts.append(torch.full((n_pad, hkv, d), 1e4))
    slots += [-1] * n_pad
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=sc.block_tables(seqs, pad=0),
        seq_lens=torch.tensor([n for n, _ in shapes], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        query_lens=q_lens,
        max_seq_len=max(n for n, _ in shapes),
        is_decode=False,
    )
    before = [c.clone() for c in sc.cache]
    scale = d**-0.5
    out = attend(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), sc.cache, meta,
                 scale, window)
    assert torch.isfinite(out).all()
    for i, s in enumerate(seqs):
        ref = sc.reference(s, scale, window)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], ref, atol=ATOL, rtol=0)
    # Every sequence's whole history is now in its blocks; nothing else moved.
    expected = [c.clone() for c in before]
    for s in seqs:
        for p in range(len(s.k)):
            expected[0][s.blocks[p // bs], p % bs] = s.k[p]
            expected[1][s.blocks[p // bs], p % bs] = s.v[p]
    for c, e in zip(sc.cache, expected, strict=True):
        assert torch.equal(c[:-1], e[:-1])


def test_plan_shared_across_layers_and_windows() -> None:
    """One plan serves layers with different windows (what the model does)."""
    sc = Scenario(4, 2, 16, 8, seed=3)
    s = sc.add(50, 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([sc.slot(s, 49)]),
        block_tables=sc.block_tables([s]),
        seq_lens=torch.tensor([50], dtype=torch.int32),
        query_start_loc=None,
        query_lens=None,
        max_seq_len=50,
        is_decode=True,
    )
    backend = SdpaBackend()
    plan = backend.prepare(meta, sc.cache, (None, 12))
    for window in (None, 12):
        out = backend.forward(s.q, s.k[49:], s.v[49:], sc.cache, plan, 0.25, window)
        torch.testing.assert_close(
            out, dense_reference(s.q, s.k, s.v, 0.25, window), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_does_not_sync_host(kv_dtype: torch.dtype) -> None:
    guard = pytest.importorskip("tests.gpu_worker.sync_guard")
    sc = Scenario(4, 2, 16, 8, seed=5, dtype=kv_dtype)
    seqs = [sc.add(n, 1) for n in (5, 30)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([sc.slot(s, len(s.k) - 1) for s in seqs] + [-1]),
        block_tables=sc.block_tables([*seqs, None]),
        seq_lens=torch.tensor([5, 30, 0], dtype=torch.int32),
        query_start_loc=None,
        query_lens=None,
        max_seq_len=32,
        is_decode=True,
    )
    q = torch.randn(3, 4, 16)
    k = torch.randn(3, 2, 16)
    with guard.forbid_host_sync():
        out = attend(q, k, k, sc.cache, meta, 0.25)
    assert out.shape == (3, 4, 16)


def test_allocate_and_bytes_per_block() -> None:
    caches = allocate_kv_cache(3, 10, 16, 2, 8, torch.bfloat16, "cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (11, 16, 2, 8)
        assert k.dtype == torch.bfloat16 and not k.any()
        assert k.data_ptr() != v.data_ptr()
    assert kv_cache_bytes_per_block(3, 2, 8, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 8 * 2
    assert kv_cache_bytes_per_block(1, 1, 1, 1, torch.float32) == 8


def test_fp8_cache_bytes_and_dtype_names() -> None:
    """fp8 costs half of bfloat16 per block and a quarter of float32; `auto` is the model's
    dtype; the names are the ones --kv-cache-dtype accepts."""
    from tandem_serve.gpu_worker.attention.kv_cache import CACHE_DTYPES
    from tandem_serve.proto.config import KV_CACHE_DTYPES

    fp8 = kv_cache_bytes_per_block(4, 2, 64, 16, FP8)
    assert 2 * fp8 == kv_cache_bytes_per_block(4, 2, 64, 16, torch.bfloat16)
    assert 4 * fp8 == kv_cache_bytes_per_block(4, 2, 64, 16, torch.float32)
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.float32) == resolve_kv_dtype("fp8_e4m3", torch.half) == FP8
    with pytest.raises(ValueError, match="fp8_e5m2"):
        resolve_kv_dtype("fp8_e5m2", torch.float32)
    assert tuple(CACHE_DTYPES) == KV_CACHE_DTYPES


def test_fp8_cache_saturates_instead_of_overflowing() -> None:
    """Past e4m3's ±448 a value is stored as ±448, never NaN; below 2**-10 it is 0."""
    sc = Scenario(2, 1, 8, 4, num_blocks=4, seed=9, dtype=FP8)
    k = torch.tensor([1e4, -1e9, 449.0, 0.3, -0.03, 1e-4, 2.0**-9, 0.0]).view(1, 1, 8)
    s = Seq(k=k, v=-k, q=torch.randn(1, 2, 8, generator=sc.gen), blocks=[sc.free.pop()])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([sc.slot(s, 0)]), block_tables=sc.block_tables([s]),
        seq_lens=torch.tensor([1], dtype=torch.int32), query_start_loc=None,
        query_lens=None, max_seq_len=1, is_decode=True)
    out = attend(s.q, k, -k, sc.cache, meta, 0.3)
    stored = sc.cache[0][s.blocks[0], 0, 0].float()
    assert stored.tolist() == [448.0, -448.0, 448.0, 0.3125, -0.029296875, 0.0, 2.0**-9, 0.0]
    assert torch.equal(sc.cache[1][s.blocks[0], 0, 0].float(), -stored)
    # One key: the output is its value, as stored.
    torch.testing.assert_close(out[0], -stored.expand(2, 8), atol=ATOL, rtol=0)
    assert torch.equal(stored, fp8_round_trip(k[0, 0]))
