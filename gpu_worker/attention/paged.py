"""Attention over the paged KV cache (`gpu_worker.attention.kv_cache` has its layout).

Two code paths:

* flash_attn (CUDA, fp16/bf16, block sizes it supports) reads the paged cache directly;
* everywhere else, the SDPA path: decode gathers each row's blocks into a dense
  ``[S, L, Hkv, D]`` tensor (L = a host-known bound) and runs one batched SDPA with a length mask;
  prefill loops over the sequences in Python.

A *mixed* forward (a step of decode rows and prefill chunk pieces, ``num_decode > 0`` and not
``is_decode``) lists its decode rows first, one query token each, then the prefill rows.  Its
decode rows' context lengths exist only on the device (they advance there), its prefill rows'
are known on the host too (``prefill_seq_lens``), so nothing in it reads the device.  Every
token's k/v is written before any row attends, so a decode row sees a prefill piece of its own
request from the same forward.  flash_attn runs all rows in one varlen call; the SDPA path
runs the decode rows as one batched call and the prefill rows as above.

Anything derived from ``AttentionMetadata`` alone (redirected slots, gather indices, masks) is
built once per forward by :func:`prepare_attention` and shared by every layer.

Sliding-window layers read only the blocks that hold a key inside their window: decode gathers
the last ``ceil((w - 1) / block_size) + 1`` blocks of each row (a fixed count, so CUDA graphs
keep static shapes) and a prefill that reads its context back starts at the block of the first
key its first query can see. Full-attention layers still read every block, so the blocks are
kept (the block table is shared by every layer).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention import flex as flex_attention
from tandem_serve.gpu_worker.attention.kv_cache import (
    KVCache,
    as_stored,
    is_fp8,
    read_blocks,
    store_rows,
)

try:  # pragma: no cover - not installed in the CPU test environment
    from flash_attn import flash_attn_varlen_func as _fa_varlen
    from flash_attn import flash_attn_with_kvcache as _fa_kvcache

    if "block_table" not in inspect.signature(_fa_varlen).parameters:
        raise ImportError("flash_attn too old: varlen without block_table")
except Exception:  # ImportError, or a broken CUDA extension raising at import
    _fa_varlen = None
    _fa_kvcache = None

# flash_attn 2.x only pages KV with block sizes that are multiples of this.
_FLASH_BLOCK_MULTIPLE = 256

@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset; -1 = do not write
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32, padded
    seq_lens: torch.Tensor  # [S] int32: context length AFTER this forward's tokens
    query_start_loc: torch.Tensor | None  # [S+1] int32 cumulative query lengths (prefill)
    query_lens: list[int] | None  # host per-sequence query lengths (prefill only)
    max_seq_len: int  # host upper bound of seq_lens
    is_decode: bool  # exactly one query token per sequence, T == S
    # Mixed forwards: the leading decode rows (one query token each), the host bound of their
    # seq_lens, and the prefill rows' seq_lens on the host (no device read needed).
    num_decode: int = 0
    decode_max_seq_len: int = 0
    prefill_seq_lens: list[int] | None = None
    # Host bounds of each decode row's seq_len (None: max_seq_len for all): rows far apart
    # in length are gathered in two groups rather than all to the longest (SDPA path).
    decode_lens: list[int] | None = None

    @property
    def is_mixed(self) -> bool:
        return self.num_decode > 0 and not self.is_decode

    def decode_part(self) -> AttentionMetadata:
        """The mixed forward's decode rows as a decode forward of their own."""
        n = self.num_decode
        return AttentionMetadata(self.slot_mapping[:n], self.block_tables[:n],
                                 self.seq_lens[:n], None, None, self.decode_max_seq_len, True,
                                 decode_lens=self.decode_lens)

    def decode_rows(self, rows: torch.Tensor, bound: int) -> AttentionMetadata:
        """Some rows of a decode forward, whose seq_lens are at most `bound`."""
        return AttentionMetadata(self.slot_mapping.index_select(0, rows),
                                 self.block_tables.index_select(0, rows),
                                 self.seq_lens.index_select(0, rows), None, None, bound, True)

    def prefill_part(self) -> AttentionMetadata:
        """The mixed forward's prefill rows as a prefill forward of their own."""
        n = self.num_decode
        assert self.query_lens is not None and self.prefill_seq_lens is not None
        return AttentionMetadata(self.slot_mapping[n:], self.block_tables[n:],
                                 self.seq_lens[n:], None, self.query_lens[n:],
                                 max(self.prefill_seq_lens), False,
                                 prefill_seq_lens=self.prefill_seq_lens)


@dataclass
class _PrefillSeq:
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
class AttentionPlan:
    """Everything paged_attention needs that depends on the metadata only, not on the layer."""

    num_blocks: int  # real blocks (scratch block excluded)
    block_size: int
    write_slots: torch.Tensor  # [T] int64, -1 redirected into the scratch block
    use_flash: bool
    # decode (SDPA path)
    gather_idx: torch.Tensor | None = None  # [S * nb] block ids
    gather_len: int = 0  # nb * block_size
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # [S,1,1,L]
    # Windows that reach fewer blocks than the rows hold: their own (block ids, length).
    window_gathers: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # prefill (SDPA path)
    seqs: list[_PrefillSeq] = field(default_factory=list)
    # flash path
    cu_seqlens_k: torch.Tensor | None = None
    max_query_len: int = 0
    # mixed forward on the SDPA path: its decode rows' plan and its prefill rows' plan
    parts: tuple[AttentionPlan, AttentionPlan] | None = None
    # mixed forward in one FlexAttention call (gpu_worker.attention.flex)
    flex: flex_attention.FlexPlan | None = None
    # decode rows in length groups (SDPA path): each group's rows and plan
    groups: list[tuple[torch.Tensor, AttentionPlan]] = field(default_factory=list)


def flash_usable(kv_cache: KVCache) -> bool:
    """Whether flash_attn can serve this cache (installed, CUDA, 16-bit, paged in 256s).
    An fp8 cache is not 16-bit: flash_attn 2 cannot read it, so it takes the SDPA path."""
    k_cache = kv_cache[0]
    return (
        _fa_varlen is not None
        and k_cache.is_cuda
        and k_cache.dtype in (torch.float16, torch.bfloat16)
        and k_cache.shape[1] % _FLASH_BLOCK_MULTIPLE == 0
    )


def prepare_attention(
    meta: AttentionMetadata,
    kv_cache: KVCache,
    sliding_windows: Iterable[int | None] = (None,),
    allow_flash: bool = True,
) -> AttentionPlan:
    """Derive the per-forward tensors shared by all layers.

    ``kv_cache`` is any layer's cache (only its shape/device are read). ``sliding_windows`` lists
    the distinct windows the model's layers use (None = full attention) so masks are built once.
    Decode performs no host sync; prefill reads ``seq_lens`` to the host once.
    """
    k_cache = kv_cache[0]
    num_blocks = k_cache.shape[0] - 1
    block_size = k_cache.shape[1]
    device = k_cache.device
    windows = list(dict.fromkeys(sliding_windows))
    slots = meta.slot_mapping.to(device=device, dtype=torch.int64)
    write_slots = torch.where(slots >= 0, slots, num_blocks * block_size)
    use_flash = allow_flash and flash_usable(kv_cache)
    plan = AttentionPlan(
        num_blocks=num_blocks, block_size=block_size, write_slots=write_slots, use_flash=use_flash
    )
    if use_flash:  # pragma: no cover - needs flash_attn on CUDA
        seq_lens = meta.seq_lens.to(torch.int32)
        plan.cu_seqlens_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
        plan.max_query_len = 1 if meta.is_decode else max(meta.query_lens or [1])
        return plan
    if meta.is_mixed and flex_attention.usable(device):
        assert meta.query_lens is not None and meta.prefill_seq_lens is not None
        flex_rows = flex_attention.Rows(meta.block_tables, meta.seq_lens, meta.num_decode,
                                        meta.decode_max_seq_len, meta.query_lens,
                                        meta.prefill_seq_lens)
        plan.flex = flex_attention.prepare_flex(flex_rows, block_size, num_blocks, windows,
                                                device)
    elif meta.is_mixed:
        plan.parts = (prepare_attention(meta.decode_part(), kv_cache, windows, False),
                      prepare_attention(meta.prefill_part(), kv_cache, windows, False))
    elif meta.is_decode and (groups := length_groups(meta.decode_lens, block_size)):
        for rows, bound in groups:
            index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
            plan.groups.append((index, prepare_attention(meta.decode_rows(index, bound),
                                                         kv_cache, windows, False)))
    elif meta.is_decode:  # fp8: float32 masks, cast to the queries' dtype on first use
        _prepare_decode(plan, meta, windows, device,
                        torch.float32 if is_fp8(k_cache) else k_cache.dtype)
    else:
        _prepare_prefill(plan, meta, windows, device)
    return plan


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


def _prepare_decode(
    plan: AttentionPlan,
    meta: AttentionMetadata,
    windows: list[int | None],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    bs = plan.block_size
    nb = max(1, min(-(-meta.max_seq_len // bs), meta.block_tables.shape[1]))
    # Pad entries may be anything (-1, garbage): clamp them onto a real block. They are masked
    # out, and a real block always holds finite values, unlike the scratch block which masked
    # rows may fill with anything.
    bt = meta.block_tables[:, :nb].to(device=device, dtype=torch.int64)
    plan.gather_idx = bt.clamp(0, plan.num_blocks - 1).reshape(-1)
    plan.gather_len = nb * bs
    pos = torch.arange(plan.gather_len, device=device)
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)[:, None]
    # clamp(min=1): a masked row may carry seq_len 0; letting it see position 0 keeps its
    # softmax finite (its output is discarded, but NaN must not reach the sampler).
    valid = pos[None, :] < seq_lens.clamp(min=1)
    zero = torch.zeros((), dtype=dtype, device=device)
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
    for w in windows:
        if w is not None and _window_span(w, bs) < nb:
            m = _prepare_window_gather(plan, bt, seq_lens, w, nb)
        else:
            m = valid if w is None else valid & (pos[None, :] >= seq_lens - w)
        # Additive float mask: SDPA would otherwise convert a bool mask on every layer.
        plan.decode_masks[w] = torch.where(m, zero, neg_inf)[:, None, None, :]


def _window_span(window: int, block_size: int) -> int:
    """The most blocks `window` consecutive positions can touch."""
    return -(-(window - 1) // block_size) + 1


def _prepare_window_gather(plan: AttentionPlan, bt: torch.Tensor, seq_lens: torch.Tensor,
                           window: int, nb: int) -> torch.Tensor:
    """Gather only each row's blocks from the one holding its oldest visible key on (a fixed
    count, computed on the device); the validity mask [S, span * block_size] of what it read."""
    bs = plan.block_size
    span = _window_span(window, bs)
    first = (seq_lens - window).clamp(min=0) // bs  # [S, 1]
    cols = first + torch.arange(span, device=bt.device)  # [S, span]
    # Past the table: clamped onto a real block, and masked below (its positions >= seq_len).
    ids = bt.gather(1, cols.clamp(max=nb - 1)).clamp(0, plan.num_blocks - 1).reshape(-1)
    plan.window_gathers[window] = (ids, span * bs)
    offsets = torch.arange(bs, device=bt.device)
    pos = (cols[:, :, None] * bs + offsets).reshape(cols.shape[0], span * bs)
    return (pos < seq_lens.clamp(min=1)) & (pos >= seq_lens - window)


def _prepare_prefill(
    plan: AttentionPlan, meta: AttentionMetadata, windows: list[int | None], device: torch.device
) -> None:
    if meta.query_lens is None:
        raise ValueError("prefill AttentionMetadata needs query_lens")
    seq_lens = meta.prefill_seq_lens
    if seq_lens is None:
        seq_lens = meta.seq_lens.tolist()  # the one host sync of a prefill forward
    bs = plan.block_size
    q_start = 0
    for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, seq_lens, strict=True)):
        prefix = ctx_len - q_len
        if prefix < 0:
            raise ValueError(f"sequence {i}: seq_len {ctx_len} < query_len {q_len}")
        block_ids = None
        if prefix > 0:
            nb = -(-ctx_len // bs)
            block_ids = meta.block_tables[i, :nb].to(device=device, dtype=torch.int64)
        seq = _PrefillSeq(q_start=q_start, q_len=q_len, ctx_len=ctx_len, block_ids=block_ids)
        q_pos = torch.arange(prefix, ctx_len, device=device)[:, None]
        for w in windows:
            if prefix == 0 and (w is None or q_len <= w):
                seq.masks[w] = None  # plain causal: SDPA's is_causal is exact here
                continue
            # Read back from the block of the first key the first query sees (fresh k/v:
            # from 0, they are all in hand).
            first = 0 if w is None or prefix == 0 else max(0, prefix - w + 1) // bs * bs
            seq.first_key[w] = first
            k_pos = torch.arange(first, ctx_len, device=device)[None, :]
            causal = k_pos <= q_pos
            # HF convention: a query sees keys with q - k < window.
            seq.masks[w] = causal if w is None else causal & (k_pos > q_pos - w)
        plan.seqs.append(seq)
        q_start += q_len


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, write_slots: torch.Tensor
) -> None:
    """Scatter this forward's k/v [T, Hkv, D] into their slots (scratch for masked rows)."""
    store_rows(kv_cache[0], write_slots, k)
    store_rows(kv_cache[1], write_slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    layer_idx: int = 0,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write k/v into the paged cache, then attend causally over each sequence's context.

    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. ``plan`` (from prepare_attention) should be
    passed by callers running several layers; without it one is built here. ``layer_idx`` is
    accepted for logging/debugging symmetry with other backends and is not needed otherwise.
    """
    if plan is None:
        plan = prepare_attention(meta, kv_cache, (sliding_window,))
    write_kv(k, v, kv_cache, plan.write_slots)
    if plan.use_flash:  # pragma: no cover - needs flash_attn on CUDA
        return _flash_attention(q, kv_cache, meta, scale, plan, sliding_window)
    if plan.flex is not None:
        return flex_attention.flex_mixed(q, kv_cache, scale, plan.flex, sliding_window)
    if plan.parts is not None:  # mixed: the decode rows first, then the prefill rows
        n = meta.num_decode
        decode, prefill = plan.parts
        return torch.cat((_decode(q[:n], kv_cache, scale, decode, sliding_window),
                          _prefill_sdpa(q[n:], k[n:], v[n:], kv_cache, scale, prefill,
                                        sliding_window)))
    if meta.is_decode:
        return _decode(q, kv_cache, scale, plan, sliding_window)
    return _prefill_sdpa(q, k, v, kv_cache, scale, plan, sliding_window)


def _decode(q: torch.Tensor, kv_cache: KVCache, scale: float, plan: AttentionPlan,
            sliding_window: int | None) -> torch.Tensor:
    if not plan.groups:
        return _decode_sdpa(q, kv_cache, scale, plan, sliding_window)
    out = torch.empty_like(q)  # every row is in one group
    for rows, group in plan.groups:  # each group gathered to its own width
        out.index_copy_(0, rows, _decode_sdpa(q.index_select(0, rows), kv_cache, scale,
                                              group, sliding_window))
    return out


def _decode_sdpa(
    q: torch.Tensor,
    kv_cache: KVCache,
    scale: float,
    plan: AttentionPlan,
    sliding_window: int | None,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    assert plan.gather_idx is not None
    idx, length = plan.gather_idx, plan.gather_len
    if sliding_window in plan.window_gathers:
        idx, length = plan.window_gathers[sliding_window]
    # index_select over whole flattened blocks is much faster on CPU than advanced indexing.
    kg = read_blocks(k_cache, idx, q.dtype).view(s, length, hkv, d).transpose(1, 2)
    vg = read_blocks(v_cache, idx, q.dtype).view(s, length, hkv, d).transpose(1, 2)
    # GQA without repeating K/V: the query heads sharing a kv head become that head's "query
    # positions" (all with the same length mask, since decode has one real position per row).
    qg = q.view(s, hkv, hq // hkv, d)
    mask = plan.decode_masks[sliding_window]
    if mask.dtype != q.dtype:  # an fp8 cache's float32 mask: cast once, for every layer
        mask = plan.decode_masks[sliding_window] = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return out.reshape(s, hq, d)


def _prefill_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    scale: float,
    plan: AttentionPlan,
    sliding_window: int | None,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    hq = q.shape[1]
    hkv = k_cache.shape[2]
    d = k_cache.shape[3]
    gqa = hq != hkv
    k, v = as_stored(k, k_cache), as_stored(v, v_cache)  # what a read-back would see
    # Zeros, not empty: rows not covered by any sequence (padding) must stay finite.
    out = torch.zeros_like(q)
    for seq in plan.seqs:
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


def _flash_attention(  # pragma: no cover - needs flash_attn on CUDA
    q: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    plan: AttentionPlan,
    sliding_window: int | None,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    block_tables = meta.block_tables.to(torch.int32)
    if meta.is_decode:
        out: torch.Tensor = _fa_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.seq_lens.to(torch.int32),
            block_table=block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=window,
        )
        return out.squeeze(1)
    assert meta.query_start_loc is not None
    n_q = int(meta.query_start_loc.shape[0])  # shape only: no sync
    out = torch.zeros_like(q)
    total = sum(meta.query_lens or [])
    out[:total] = _fa_varlen(
        q[:total],
        k_cache,
        v_cache,
        cu_seqlens_q=meta.query_start_loc.to(torch.int32),
        cu_seqlens_k=plan.cu_seqlens_k,
        max_seqlen_q=plan.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        block_table=block_tables[: n_q - 1],
    )
    return out
