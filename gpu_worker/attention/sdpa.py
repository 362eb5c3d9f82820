"""The SDPA backend: torch's scaled_dot_product_attention over blocks gathered from the paged
cache.  It runs everywhere (any device, dtype, fp8 cache and block size), and is what `auto`
picks on the CPU and wherever neither flash_attn nor FlexAttention can serve.

* Decode gathers each row's blocks into a dense ``[S, L, Hkv, D]`` tensor (L: a host-known
  bound, so CUDA graphs keep static shapes) and runs one batched SDPA with a length mask.
  Rows far apart in length (a prompt that just joined among short streams) gather in two
  groups, each to its own width (`length_groups`).
* Prefill loops over the rows in Python: a row whose context is all this forward's tokens
  attends over its fresh k/v (plain causal), one after a cached prefix or an earlier chunk
  reads its context back from the cache.
* A mixed forward (decode rows first, then prefill rows) runs its decode rows as one decode
  call and its prefill rows as above (the split path).

Sliding-window layers read only the blocks that hold a key inside their window: decode gathers
the last ``ceil((w - 1) / block_size) + 1`` blocks of each row (a fixed count) and a prefill
that reads its context back starts at the block of the first key its first query can see.
Full-attention layers still read every block, so the blocks are kept (the block table is
shared by every layer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    last_visible,
)
from tandem_serve.gpu_worker.attention.kv_cache import (
    KVCache,
    as_stored,
    is_fp8,
    read_blocks,
    write_kv,
    write_slots,
)


@dataclass
class DecodeGather:
    """Decode rows gathered to one width: what their layers' SDPA calls share."""

    gather_idx: torch.Tensor  # [S * nb] block ids
    gather_len: int  # nb * block_size
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # [S, 1, 1, L]
    # Windows that reach fewer blocks than the rows hold: their own (block ids, length).
    window_gathers: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_len: int
    # Block ids covering the context; None when the whole context is this forward's tokens
    # (then attention runs on the fresh k/v and the cache is only written).
    block_ids: torch.Tensor | None
    # Boolean [q_len, ctx_len - first key] masks keyed by sliding window; None = plain causal.
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    # Per window, the first key position read back from the cache (a block boundary): keys
    # before it are outside the window of every query of the sequence.
    first_key: dict[int | None, int] = field(default_factory=dict)


@dataclass
class SdpaPlan:
    block_size: int
    write_slots: torch.Tensor  # [T] int64, -1 redirected into the scratch block
    num_decode: int = 0  # a mixed forward's leading decode rows
    # The decode rows as (rows, gather) groups; rows None: every decode row, in one gather.
    decode: list[tuple[torch.Tensor | None, DecodeGather]] = field(default_factory=list)
    # The prefill rows (None: a decode forward).
    prefill: list[PrefillSeq] | None = None


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    bidirectional = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int) -> str | None:
        return None

    def prepare(self, meta: AttentionMetadata, kv_cache: KVCache,
                windows: Sequence[int | None] = (None,)) -> SdpaPlan:
        """Decode and mixed forwards read nothing back; a prefill forward whose metadata
        lacks `prefill_seq_lens` reads `seq_lens` to the host once."""
        ws = list(dict.fromkeys(windows))
        plan = SdpaPlan(kv_cache[0].shape[1], write_slots(meta.slot_mapping, kv_cache))
        if meta.is_decode:
            plan.decode = decode_gathers(meta, kv_cache, ws)
        elif meta.is_mixed:
            plan.num_decode = meta.num_decode
            plan.decode = decode_gathers(meta.decode_part(), kv_cache, ws)
            plan.prefill = prefill_seqs(meta.prefill_part(), plan.block_size, ws,
                                        kv_cache[0].device)
        else:
            plan.prefill = prefill_seqs(meta, plan.block_size, ws, kv_cache[0].device)
        return plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                plan: SdpaPlan, scale: float, sliding_window: int | None = None
                ) -> torch.Tensor:
        write_kv(k, v, kv_cache, plan.write_slots)
        return attend(q, k, v, kv_cache, plan, scale, sliding_window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
           plan: SdpaPlan, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Attention once this forward's k/v are in the cache (the flex backend's decode and
    prefill forwards come here too)."""
    if plan.prefill is None:
        return _decode(q, kv_cache, scale, plan.decode, sliding_window)
    n = plan.num_decode
    if n == 0:
        return _prefill(q, k, v, kv_cache, scale, plan, sliding_window)
    return torch.cat((_decode(q[:n], kv_cache, scale, plan.decode, sliding_window),
                      _prefill(q[n:], k[n:], v[n:], kv_cache, scale, plan, sliding_window)))


# ---------------------------------------------------------------------------------- decode


def length_groups(lens: list[int] | None, block_size: int
                  ) -> list[tuple[list[int], int]] | None:
    """Decode rows as (rows, seq_len bound) groups when gathering the short ones to their own
    width saves at least 40% of the blocks the longest row's width costs (one long row among
    short ones: a prompt that just joined); else None (one gather)."""
    if not lens or len(lens) < 2:
        return None
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    width = [-(-lens[i] // block_size) for i in order]
    whole = len(lens) * width[-1]
    cost, cut = min((i * width[i - 1] + (len(lens) - i) * width[-1], i)
                    for i in range(1, len(lens)))
    if cost > 0.6 * whole:
        return None
    return [(order[:cut], lens[order[cut - 1]]), (order[cut:], lens[order[-1]])]


def decode_gathers(meta: AttentionMetadata, kv_cache: KVCache, windows: list[int | None]
                   ) -> list[tuple[torch.Tensor | None, DecodeGather]]:
    """A decode forward's rows in one gather, or in length groups (`decode_lens`)."""
    k_cache = kv_cache[0]
    groups = length_groups(meta.decode_lens, k_cache.shape[1])
    if groups is None:
        return [(None, _gather(meta, kv_cache, windows))]
    out: list[tuple[torch.Tensor | None, DecodeGather]] = []
    for rows, bound in groups:
        index = torch.tensor(rows, dtype=torch.int64).to(k_cache.device, non_blocking=True)
        out.append((index, _gather(meta.decode_rows(index, bound), kv_cache, windows)))
    return out


def _gather(meta: AttentionMetadata, kv_cache: KVCache, windows: list[int | None]
            ) -> DecodeGather:
    k_cache = kv_cache[0]
    num_blocks, bs, device = k_cache.shape[0] - 1, k_cache.shape[1], k_cache.device
    # fp8: float32 masks, cast to the queries' dtype on first use.
    dtype = torch.float32 if is_fp8(k_cache) else k_cache.dtype
    nb = max(1, min(-(-meta.max_seq_len // bs), meta.block_tables.shape[1]))
    # Pad entries may be anything (-1, garbage): clamp them onto a real block. They are masked
    # out, and a real block always holds finite values, unlike the scratch block which masked
    # rows may fill with anything.
    bt = meta.block_tables[:, :nb].to(device=device, dtype=torch.int64)
    g = DecodeGather(bt.clamp(0, num_blocks - 1).reshape(-1), nb * bs)
    pos = torch.arange(g.gather_len, device=device)
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)[:, None]
    # clamp(min=1): a masked row may carry seq_len 0; letting it see position 0 keeps its
    # softmax finite (its output is discarded, but NaN must not reach the sampler).
    valid = pos[None, :] < seq_lens.clamp(min=1)
    zero = torch.zeros((), dtype=dtype, device=device)
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
    for w in windows:
        if w is not None and _window_span(w, bs) < nb:
            m = _window_gather(g, bt, seq_lens, w, bs, num_blocks)
        else:
            m = valid if w is None else valid & (pos[None, :] >= seq_lens - w)
        # Additive float mask: SDPA would otherwise convert a bool mask on every layer.
        g.masks[w] = torch.where(m, zero, neg_inf)[:, None, None, :]
    return g


def _window_span(window: int, block_size: int) -> int:
    """The most blocks `window` consecutive positions can touch."""
    return -(-(window - 1) // block_size) + 1


def _window_gather(g: DecodeGather, bt: torch.Tensor, seq_lens: torch.Tensor, window: int,
                   bs: int, num_blocks: int) -> torch.Tensor:
    """Gather only each row's blocks from the one holding its oldest visible key on (a fixed
    count, computed on the device); the validity mask [S, span * block_size] of what it read."""
    nb = bt.shape[1]
    span = _window_span(window, bs)
    first = (seq_lens - window).clamp(min=0) // bs  # [S, 1]
    cols = first + torch.arange(span, device=bt.device)  # [S, span]
    # Past the table: clamped onto a real block, and masked below (its positions >= seq_len).
    ids = bt.gather(1, cols.clamp(max=nb - 1)).clamp(0, num_blocks - 1).reshape(-1)
    g.window_gathers[window] = (ids, span * bs)
    offsets = torch.arange(bs, device=bt.device)
    pos = (cols[:, :, None] * bs + offsets).reshape(cols.shape[0], span * bs)
    return (pos < seq_lens.clamp(min=1)) & (pos >= seq_lens - window)


def _decode(q: torch.Tensor, kv_cache: KVCache, scale: float,
            gathers: list[tuple[torch.Tensor | None, DecodeGather]],
            sliding_window: int | None) -> torch.Tensor:
    rows, gather = gathers[0]
    if rows is None:
        return _decode_sdpa(q, kv_cache, scale, gather, sliding_window)
    out = torch.empty_like(q)  # every row is in one group
    for rows, gather in gathers:  # each group gathered to its own width
        assert rows is not None
        out.index_copy_(0, rows, _decode_sdpa(q.index_select(0, rows), kv_cache, scale,
                                              gather, sliding_window))
    return out


def _decode_sdpa(q: torch.Tensor, kv_cache: KVCache, scale: float, g: DecodeGather,
                 sliding_window: int | None) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    idx, length = g.gather_idx, g.gather_len
    if sliding_window in g.window_gathers:
        idx, length = g.window_gathers[sliding_window]
    # index_select over whole flattened blocks is much faster on CPU than advanced indexing.
    kg = read_blocks(k_cache, idx, q.dtype).view(s, length, hkv, d).transpose(1, 2)
    vg = read_blocks(v_cache, idx, q.dtype).view(s, length, hkv, d).transpose(1, 2)
    # GQA without repeating K/V: the query heads sharing a kv head become that head's "query
    # positions" (all with the same length mask, since decode has one real position per row).
    qg = q.view(s, hkv, hq // hkv, d)
    mask = g.masks[sliding_window]
    if mask.dtype != q.dtype:  # an fp8 cache's float32 mask: cast once, for every layer
        mask = g.masks[sliding_window] = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return out.reshape(s, hq, d)


# --------------------------------------------------------------------------------- prefill


def prefill_seqs(meta: AttentionMetadata, block_size: int, windows: list[int | None],
                 device: torch.device) -> list[PrefillSeq]:
    if meta.query_lens is None:
        raise ValueError("prefill AttentionMetadata needs query_lens")
    seq_lens = meta.prefill_seq_lens
    if seq_lens is None:
        seq_lens = meta.seq_lens.tolist()  # the one host sync of a prefill forward
    bs = block_size
    out = []
    q_start = 0
    for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, seq_lens, strict=True)):
        prefix = ctx_len - q_len
        if prefix < 0:
            raise ValueError(f"sequence {i}: seq_len {ctx_len} < query_len {q_len}")
        block_ids = None
        if prefix > 0:
            nb = -(-ctx_len // bs)
            block_ids = meta.block_tables[i, :nb].to(device=device, dtype=torch.int64)
        seq = PrefillSeq(q_start=q_start, q_len=q_len, ctx_len=ctx_len, block_ids=block_ids)
        q_pos = torch.arange(prefix, ctx_len, device=device)[:, None]
        spans = meta.bidirectional[i] if meta.bidirectional else []
        # The last key each query sees: itself, or the end of its image (Gemma 3).
        hi = torch.from_numpy(last_visible(np.arange(prefix, ctx_len), spans)).to(
            device)[:, None] if spans else q_pos
        for w in windows:
            if prefix == 0 and not spans and (w is None or q_len <= w):
                seq.masks[w] = None  # plain causal: SDPA's is_causal is exact here
                continue
            # Read back from the block of the first key the first query sees (fresh k/v:
            # from 0, they are all in hand).
            first = 0 if w is None or prefix == 0 else max(0, prefix - w + 1) // bs * bs
            seq.first_key[w] = first
            k_pos = torch.arange(first, ctx_len, device=device)[None, :]
            causal = k_pos <= hi
            # HF convention: a query sees keys with q - k < window.
            seq.masks[w] = causal if w is None else causal & (k_pos > q_pos - w)
        out.append(seq)
        q_start += q_len
    return out


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
             scale: float, plan: SdpaPlan, sliding_window: int | None) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    hq = q.shape[1]
    hkv = k_cache.shape[2]
    d = k_cache.shape[3]
    gqa = hq != hkv
    k, v = as_stored(k, k_cache), as_stored(v, v_cache)  # what a read-back would see
    # Zeros, not empty: rows not covered by any sequence (padding) must stay finite.
    out = torch.zeros_like(q)
    assert plan.prefill is not None
    for seq in plan.prefill:
        a, b = seq.q_start, seq.q_start + seq.q_len
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if seq.block_ids is None:
            ks = k[a:b].transpose(0, 1).unsqueeze(0)
            vs = v[a:b].transpose(0, 1).unsqueeze(0)
        else:
            # Context spans earlier chunks / a shared prefix: read it back from the cache,
            # from the first block this layer's window reaches.
            first = seq.first_key.get(sliding_window, 0)
            n = seq.ctx_len - first
            blocks = seq.block_ids[first // plan.block_size:]
            ks = read_blocks(k_cache, blocks, q.dtype).view(-1, hkv, d)[:n]
            vs = read_blocks(v_cache, blocks, q.dtype).view(-1, hkv, d)[:n]
            ks = ks.transpose(0, 1).unsqueeze(0)
            vs = vs.transpose(0, 1).unsqueeze(0)
        mask = seq.masks[sliding_window]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        out[a:b] = o[0].transpose(0, 1)
    return out
