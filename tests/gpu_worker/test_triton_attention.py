"""The Triton paged-attention kernels (`gpu_worker.attention.triton_kernels`) against a plain dense
float32 attention over each row's context gathered from the block table.

Without a CUDA device the kernels run under Triton's interpreter (numpy on the CPU), which is
slow: shapes stay tiny (head dims 16-48, one or two kv heads, a handful of rows).  With one,
the same cases run compiled.  Every cache slot no row may read holds NaN (unused blocks, the
tail of a row's last block, blocks wholly before a sliding window, whose table entries are
garbage too), so a read outside a row's visible keys shows up as NaN in the output.
"""
from __future__ import annotations

import pytest
import torch

from tandem_serve.gpu_worker.attention.kv_cache import FP8, store_rows
from tests.gpu_worker.triton_utils import DEVICE, load_kernels

ta = load_kernels()




def _make_case(rows, *, block_size, kv_heads, group, head_dim, window=None, dtype=torch.float32,
               cache_dtype=None, pad_tokens=0, seed=0):
    """Random caches, shuffled block tables and queries for `rows` [(q_len, seq_len)].

    Returns the kernel's inputs and the float32 reference output."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    bs = block_size
    need = [-(-seq_len // bs) for _, seq_len in rows]
    num_blocks = sum(need) + 3
    shape = (num_blocks + 1, bs, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan")).to(cache_dtype) for _ in range(2)]
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need + [1]) + 2
    # Pad entries: -1, or the scratch block (NaN, so a read shows rather than crashes).
    garbage = (-1, num_blocks)
    tables = torch.tensor([garbage[(i + j) % 2] for i in range(len(rows)) for j in range(width)],
                          dtype=torch.int32).view(len(rows), width)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    for i, (_, seq_len) in enumerate(rows):  # the context, through the cache's own writes
        pos = torch.arange(seq_len)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        for cache in caches:
            store_rows(cache, slots, torch.randn(seq_len, kv_heads, head_dim, generator=gen,
                                                 dtype=torch.float32).to(dtype))
    q_lens = [q_len for q_len, _ in rows]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(q_lens) + pad_tokens, group * kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    ref = reference(q, *caches, tables, qsl, rows, scale, window)
    if window is not None:  # blocks no query of a row can see: garbage entries, NaN contents
        for i, (q_len, seq_len) in enumerate(rows):
            first_visible = max(0, seq_len - q_len - window + 1)
            for j in range(first_visible // bs):
                for cache in caches:
                    cache.view(torch.uint8)[tables[i, j].item()] = 0xFF  # NaN in every dtype
                tables[i, j] = garbage[j % 2]
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, *caches, tables, seq_lens, qsl)]
    return args, ref


def reference(q, k_cache, v_cache, tables, qsl, rows, scale, window):
    """Per row, softmax(q k^T * scale) v over the keys each query sees, in float32."""
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, (q_len, seq_len) in enumerate(rows):
        if q_len == 0 or seq_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = tables[i, pos // bs].long()
        k = k_cache.float()[blocks, pos % bs].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache.float()[blocks, pos % bs].repeat_interleave(group, dim=1)
        a = int(qsl[i])
        qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = pos[None, :] <= qpos
        if window is not None:
            visible &= qpos - pos[None, :] < window
        s = torch.einsum("qhd,khd->hqk", q[a:a + q_len].float(), k) * scale
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        out[a:a + q_len] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def _run(args, rows, window=None, num_splits=None, out=None, max_query_len=None):
    q, k_cache, v_cache, tables, seq_lens, qsl = args
    paged = ta.PagedRows(tables, seq_lens, qsl, max_query_len or max(q for q, _ in rows),
                         max(s for _, s in rows), num_splits)
    return ta.unified_attention(q, (k_cache, v_cache), paged, q.shape[-1] ** -0.5, window,
                                out)


def _check(got, ref, tol):
    got = got.float().cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


D, P = 1, 40  # shorthands: a decode row (q_len 1), a prefill chunk of 40 queries
CASES = {
    # name: (rows [(q_len, seq_len)], block_size, kv heads, group, head dim, window)
    "decode": ([(1, 1), (1, 17), (1, 64), (1, 100)], 16, 2, 2, 32, None),
    "prefill": ([(P, P), (20, 70), (33, 33)], 32, 1, 4, 16, None),
    "mixed": ([(1, 50), (1, 3), (P, 90), (7, 7)], 16, 2, 1, 24, None),
    "verify": ([(3, 3), (3, 45), (3, 130)], 16, 1, 4, 16, None),
    "window": ([(1, 90), (1, 12), (P, 120), (30, 30)], 16, 1, 2, 48, 20),
    # 97: the first visible key (64) starts a block, the one before it is NaN
    # group 3: a tile of 5 positions x 3 heads leaves one of its 16 rows idle
    "window_decode": ([(1, 97), (3, 100)], 32, 2, 3, 16, 33),
    "long": ([(1, 2048), (1, 1500), (64, 2048)], 32, 1, 2, 16, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_reference(name):
    rows, bs, kv_heads, group, head_dim, window = CASES[name]
    args, ref = _make_case(rows, block_size=bs, kv_heads=kv_heads, group=group,
                           head_dim=head_dim, window=window)
    whole = _run(args, rows, window, num_splits=1)
    _check(whole, ref, 1e-5)
    split = _run(args, rows, window, num_splits=3)  # split-KV: the same result
    _check(split, ref, 1e-5)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_auto_splits_long_decode():
    """Few decode rows over long contexts: the chosen split count is > 1 and agrees."""
    rows = [(1, 2000), (1, 700)]
    assert ta.choose_num_splits(2, 1, 2, 1, 2000, "cpu") > 1
    args, ref = _make_case(rows, block_size=16, kv_heads=1, group=2, head_dim=16, seed=1)
    _check(_run(args, rows), ref, 1e-5)


def test_bounds_are_only_hints():
    """max_query_len picks the tiles; a too-small bound (a mixed batch passed as decode)
    changes them but not the result, and q may be a strided view (a fused qkv)."""
    rows = [(1, 20), (9, 40), (1, 33)]
    args, ref = _make_case(rows, block_size=16, kv_heads=2, group=2, head_dim=16, seed=2)
    q = args[0]
    fused = torch.cat([q, torch.zeros_like(q)], dim=1)  # [T, 2 Hq, D]: q is its first half
    args[0] = fused[:, : q.shape[1]]
    assert not args[0].is_contiguous()
    _check(_run(args, rows, max_query_len=1), ref, 1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_and_empty_rows_are_zero(num_splits):
    """Tokens past query_start_loc[-1] and a row with no context (a masked decode row:
    seq_len 0) come out as zeros, into an `out` that held NaN."""
    rows = [(1, 0), (1, 30), (5, 21), (0, 9)]
    args, ref = _make_case(rows, block_size=16, kv_heads=1, group=2, head_dim=16,
                           pad_tokens=5, seed=3)
    out = torch.full_like(args[0], float("nan"))
    got = _run(args, rows, num_splits=num_splits, out=out)
    assert got is out
    _check(got, ref, 1e-5)
    assert (got[0] == 0).all() and (got[-5:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(dtype):
    """An e4m3 cache is upcast by a plain cast, as read_blocks does: float32 queries match
    the reference on the upcast cache to float32 rounding.  bfloat16 queries multiply in
    bf16 and round P to bf16 (8 bits: 2^-8 relative) before P V, like every bf16 flash
    kernel, and the output to bf16: 2e-2 covers that over unit-variance values."""
    rows = [(1, 60), (3, 35), (24, 50)]
    args, ref = _make_case(rows, block_size=16, kv_heads=1, group=2, head_dim=16, dtype=dtype,
                           cache_dtype=FP8, window=40, seed=4)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_splits in (1, 2):
        got = _run(args, rows, window=40, num_splits=num_splits)
        assert got.dtype == dtype
        _check(got, ref, tol)


def test_rejects_bad_shapes():
    rows = [(1, 5)]
    args, _ = _make_case(rows, block_size=16, kv_heads=2, group=1, head_dim=16)
    with pytest.raises(ValueError, match="kv heads"):
        _run([args[0][:, :1], *args[1:]], rows)
    with pytest.raises(ValueError, match="sliding_window"):
        _run(args, rows, window=0)
