"""Paged attention in Triton: one kernel family for decode rows, speculative verify rows and
prefill chunks, reading K/V through the block table in place (`gpu_worker.attention.kv_cache`
has the layout: per layer [num_blocks + 1, block_size, Hkv, D], the last block scratch).

The queries of a forward are rows laid out one sequence after another (``query_start_loc``,
[S + 1] cumulative); a row's queries are the last ``q_len`` positions of its context
(``seq_lens``: the context length after this forward's tokens, whose K/V the caller has
already written), attending causally, optionally within a sliding window (HF convention: a
query at position p sees keys k with p - k < w).

Kernel design:

* A program owns one kv head and a *query tile* of one sequence: ``BLOCK_Q`` consecutive
  query positions times the ``G = Hq / Hkv`` query heads sharing that kv head, packed as the
  ``BLOCK_M = BLOCK_Q * G`` (padded to a power of two) rows of one ``tl.dot`` operand, so
  GQA reads each K/V tile once for the whole group.  Decode rows (q_len 1) and long prefill
  rows share the kernel: a row spans ``cdiv(q_len, BLOCK_Q)`` tiles.
* Grid axis 0 has ``cdiv(T, BLOCK_Q) + S`` programs (T = q.shape[0], S rows): sequence i's
  tiles start at ``query_start_loc[i] // BLOCK_Q + i``, a program finds its sequence by a
  binary search over ``query_start_loc`` and programs past the last tile zero the padding
  tokens ``[query_start_loc[S], T)``.  The grid depends on shapes and host bounds only, the
  lengths are read on the device: nothing syncs, so a launch can be captured in a CUDA graph.
* K/V tiles of ``TILE_N`` keys (a power of two, independent of the block size) look up each
  key's block in the block table with masked loads: nothing outside the keys a tile needs
  (pad entries, blocks before a sliding window) is read.  Online softmax in fp32 (exp2 with
  the scale folded in); fp8 caches are upcast on load by a plain cast, as ``read_blocks``.
* Split-KV (flash-decoding): with ``num_splits`` > 1 axis 2 cuts each tile's key range into
  that many contiguous pieces; each writes its running max, sum and unnormalised output to a
  float32 workspace and ``_reduce_kernel`` (one program per token and query head) combines
  them.  Worth it when few rows have long contexts; ``choose_num_splits`` picks the count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem_serve.gpu_worker.attention.kv_cache import is_fp8

_LOG2E = 1.4426950408889634
# Split-KV only for rows this short (decode, verify): the workspace grows with T x splits.
_SPLIT_MAX_QUERY_LEN = 8
_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query tile ``qsl[i] // BLOCK_Q + i`` is <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Lengths and counts that change from call to call: no specialisation (an int equal to 1,
# or a multiple of 16, would otherwise compile a variant of its own).
@triton.jit(do_not_specialize=["window", "num_seqs", "num_tokens"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr,
    bt_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, window, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WINDOWED: tl.constexpr, F32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, TILE_N)
    qi = offs_m // GROUP  # query position within the tile; rows past BLOCK_Q * GROUP idle
    head = kv_head * GROUP + offs_m % GROUP
    d_ok = offs_d < HEAD_DIM

    n_queries = tl.load(qsl_ptr + num_seqs)
    pad_start = n_queries // BLOCK_Q + num_seqs
    if tile >= pad_start:
        # Past every sequence's tiles: zero the padding tokens (the reduce does it on split).
        if NUM_SPLITS == 1:
            tok = n_queries + (tile - pad_start) * BLOCK_Q + qi
            ok = (qi < BLOCK_Q) & (tok < num_tokens)
            ptrs = (out_ptr + tok.to(tl.int64)[:, None] * stride_ot
                    + head[:, None] * stride_oh + offs_d[None, :])
            zero = tl.zeros([BLOCK_M, D_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(ptrs, zero, mask=ok[:, None] & d_ok[None, :])
        return

    seq = _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # a gap between two sequences' tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # context before this forward's queries
    q_idx = q_tile * BLOCK_Q + qi
    # (tok < num_tokens: a query_start_loc past q's rows writes nothing out of bounds.)
    row_ok = (qi < BLOCK_Q) & (q_idx < q_len) & (q_start + q_idx < num_tokens)
    tok = (q_start + q_idx).to(tl.int64)
    pos = prefix + q_idx  # each row's query position in its sequence
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys [lo, hi) some row of the tile can see; kept non-negative (integer division of
    # negatives differs between the compiler and the interpreter).
    first = prefix + q_tile * BLOCK_Q
    hi = tl.maximum(tl.minimum(prefix + q_len, first + BLOCK_Q), 0)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(first - window + 1, 0)
    hi = tl.maximum(hi, lo)
    t_lo = lo // TILE_N
    t_hi = (hi + TILE_N - 1) // TILE_N
    per_split = (t_hi - t_lo + NUM_SPLITS - 1) // NUM_SPLITS
    s_lo = t_lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, t_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for t in range(s_lo, s_hi):
        keys = t * TILE_N + offs_n
        k_ok = (keys >= lo) & (keys < hi)
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        k_ptrs = (k_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks
                  + kv_head * stride_kh + offs_d[:, None])
        k = tl.load(k_ptrs, mask=d_ok[:, None] & k_ok[None, :], other=0.0).to(q.dtype)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        visible = row_ok[:, None] & k_ok[None, :] & (keys[None, :] <= pos[:, None])
        if WINDOWED:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                  + kv_head * stride_vh + offs_d[None, :])
        v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        if F32_DOT:  # P rounded to v's dtype first, as the 16-bit dot below does
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key (seq_len 0): zeros
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (tok * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(acc_ws_ptr + part[:, None] * D_PAD + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(m_ws_ptr + part, m_i, mask=row_ok)
        tl.store(l_ws_ptr + part, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def _reduce_kernel(
    out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, qsl_ptr, num_seqs, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    # Padding tokens have no partials (their workspace is garbage): they read nothing.  (A
    # bound, not `vector & scalar`: the interpreter turns that mask into int32.)
    s_ok = offs_s < tl.where(tok < tl.load(qsl_ptr + num_seqs), NUM_SPLITS, 0)
    part = (tok * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(m_ws_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_ws_ptr + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    total = tl.sum(l_s * w, 0)
    acc = tl.load(acc_ws_ptr + part[:, None] * D_PAD + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 132  # the interpreter: any count works, one like the target GPU's


def _f32_dot(q: torch.Tensor) -> bool:
    """Whether the dots run on float32 operands at full precision: for float32 queries (the
    compiled default would round them to tf32), and in the interpreter for bfloat16 ones
    (its bf16 dot multiplies the raw bits as integers; the fp32 dot of bf16 values is what
    a bf16 MMA with fp32 accumulation computes)."""
    return q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not q.is_cuda)


def _tiles(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N): rows of query heads x positions, keys per tile."""
    rows = max(1, max_query_len) * group
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one position a tile
    tile_n = 32 if max_query_len <= _SPLIT_MAX_QUERY_LEN else 64
    return block_m, block_m // group, tile_n


def choose_num_splits(num_seqs: int, num_kv_heads: int, group: int, max_query_len: int,
                      max_seq_len: int, device: torch.device | str = "cuda") -> int:
    """How many pieces to cut each row's keys into: 1 unless the rows are short (decode,
    verify) and too few to fill the device while their contexts are long.  A function of
    host numbers only (a graph can be captured with it); the count changes the speed and
    the last bits of rounding, never which keys a query sees."""
    if max_query_len > _SPLIT_MAX_QUERY_LEN or max_seq_len < 2 * _MIN_KEYS_PER_SPLIT:
        return 1
    _, block_q, _ = _tiles(group, max_query_len)
    programs = max(1, num_seqs * triton.cdiv(max_query_len, block_q) * num_kv_heads)
    target = 2 * _sm_count(torch.device(device))
    splits = min(triton.cdiv(target, programs), max_seq_len // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS)
    return max(1, splits)


@dataclass(frozen=True)
class PagedRows:
    """Where a forward's rows are: their queries' places in q, their contexts' blocks and
    lengths (all on q's device), and host bounds.  One per forward, shared by every layer."""

    block_tables: torch.Tensor  # int32 [>= S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]: context lengths after this forward's tokens
    query_start_loc: torch.Tensor  # int32 [S + 1]
    max_query_len: int
    max_seq_len: int
    num_splits: int | None = None  # split-KV pieces (None: choose_num_splits)


def unified_attention(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      rows: PagedRows, scale: float, sliding_window: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each row's queries over its paged context, read from the cache.

    q [T, Hq, D] (last dim contiguous; rows may be strided, e.g. a view of a fused qkv):
    row i's queries are tokens ``query_start_loc[i]:query_start_loc[i + 1]`` (an int32
    [S + 1] cumulative, on q's device), the last ``q_len`` positions of a context of
    ``seq_lens[i]`` tokens (int32 [S]) whose K/V the caller already wrote into
    ``k_cache``/``v_cache`` [num_blocks + 1, block_size, Hkv, D] (q's dtype, or
    float8_e4m3fn read by a plain cast).  ``block_tables`` [>= S, max_blocks] (int32) maps
    a row's block j to a cache block; entries past a row's context (and, with a window,
    before it) are never read, so padding may hold -1 or anything.  Decode rows, verify rows
    and prefill chunks mix freely in one call (the order does not matter).

    ``sliding_window``: None, or w >= 1 (a query at position p sees keys p - w < k <= p).
    ``max_query_len`` / ``max_seq_len``: host bounds of the rows' query and context lengths,
    used only to choose tiles and the split count, never for correctness.  ``num_splits``:
    split-KV pieces (None: ``choose_num_splits``).  The grid depends on T, S, Hkv and the
    split count alone and nothing reads the device, so calls can be captured in CUDA graphs.

    Returns ``out`` (or a new [T, Hq, D] tensor in q's dtype): tokens past
    ``query_start_loc[S]`` (padding) and rows whose context is empty come out as zeros.
    """
    k_cache, v_cache = kv_cache
    block_tables, seq_lens, query_start_loc = rows.block_tables, rows.seq_lens, \
        rows.query_start_loc
    max_query_len, max_seq_len, num_splits = rows.max_query_len, rows.max_seq_len, \
        rows.num_splits
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} must be [T, Hq, D] and k/v caches alike "
                         f"[blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} kv "
                         f"heads of dim {cache_dim}")
    for c in (k_cache, v_cache):
        if c.dtype != q.dtype and not is_fp8(c):
            raise ValueError(f"cache dtype {c.dtype} is neither q's ({q.dtype}) nor fp8")
        if c.stride(-1) != 1:
            raise ValueError("the caches' last dim must be contiguous")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"{num_seqs} rows need query_start_loc [{num_seqs + 1}] and "
                         f"block_tables [>= {num_seqs}, ...]")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, group, max_query_len,
                                       max_seq_len, q.device)
    num_splits = max(1, int(num_splits))
    block_m, block_q, tile_n = _tiles(group, max_query_len)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        parts = (num_tokens, num_heads, num_splits)
        acc_ws = torch.empty(parts + (d_pad,), dtype=torch.float32, device=q.device)
        m_ws = torch.empty(parts, dtype=torch.float32, device=q.device)
        l_ws = torch.empty(parts, dtype=torch.float32, device=q.device)
    else:
        acc_ws = m_ws = l_ws = out  # not touched
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, num_splits)
    _attention_kernel[grid](
        q, k_cache, v_cache, out, acc_ws, m_ws, l_ws,
        block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, sliding_window or 0, num_seqs, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        NUM_SPLITS=num_splits, WINDOWED=sliding_window is not None,
        F32_DOT=_f32_dot(q), num_warps=4,
    )
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out, acc_ws, m_ws, l_ws, query_start_loc, num_seqs, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
        )
    return out
