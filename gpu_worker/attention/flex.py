"""The flex backend: a mixed forward's rows in one FlexAttention call, whatever their query
lengths; decode and prefill forwards as the SDPA backend runs them (`sdpa`).

The rows' contexts are gathered from the paged cache into one packed KV sequence, row after
row (a decode row: the decode gather width, a host bound; a prefill row: the blocks its
context covers), and the queries are packed the same way.  A query may see a key of its own
row at a position up to its own (and inside its sliding window); the block mask lists, for
each block of 16 queries, the contiguous range of KV blocks its rows' contexts cover, built
on the host from lengths the host knows, so nothing is read back and no [T, C] mask is
evaluated.  Decode rows' exact lengths live on the device only: their query positions come
from the device, and the mask bounds each key by the query's position.

Why 16 queries a block: a block of decode rows (one query each) is computed against every
context in its block; 16 keeps that waste small while the kernel's tiles stay legal (the
kernel's BLOCK_M must divide the mask's block, and tensor-core tiles want >= 16).  vLLM's
FlexAttention backend makes the same choice.

On CUDA the call is compiled, once, at start-up (`warm_up`, over a dummy decode and prefill
row: the compile is shape-dynamic, so one serves every step); a compile that fails there
makes `auto` choose the SDPA backend, logged (`registry.select_backend`).  On the CPU the
split path is faster (one batched decode call and one call per prefill row: the eager
flex_attention materialises every score), so `auto` never picks it there; named
(`--attention-backend flex`) it runs eagerly, as the tests run it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    WarmUp,
    last_visible,
)
from tandem_serve.gpu_worker.attention.kv_cache import KVCache, read_blocks, write_kv, write_slots
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend, SdpaPlan

Q_BLOCK = 16
KV_BLOCK = 64


@dataclass
class FlexPlan:
    """What every layer's call shares: the packed layout and one block mask per window."""

    write_slots: torch.Tensor  # [T] int64, -1 redirected into the scratch block
    gather_idx: torch.Tensor  # [C / block_size] block ids, the rows' contexts in order
    num_tokens: int  # T, before padding to a whole query block
    masks: dict[int | None, Any] = field(default_factory=dict)  # window -> BlockMask


class FlexBackend(AttentionBackend):
    name = "flex"
    bidirectional = True

    def __init__(self) -> None:
        self.split = SdpaBackend()  # decode and prefill forwards

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int) -> str | None:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as exc:
            return f"this torch ({torch.__version__}) has no FlexAttention: {exc}"
        return None

    @classmethod
    def auto_skips(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                   block_size: int) -> str | None:
        if device.type != "cuda":
            return "slower than sdpa's split path on the CPU (eager, every score materialised)"
        return cls.supports(device, dtype, kv_dtype, block_size)

    def warm_up(self, probe: WarmUp) -> None:
        """Compile the kernel now, over a dummy decode row and a 16-token prefill row, rather
        than in the first mixed step, where every decoding stream would wait seconds for it;
        one call per window, reading the cache and writing nothing."""
        k_cache = probe.kv_cache[0]
        dev, bs = k_cache.device, k_cache.shape[1]
        width = -(-16 // bs)
        meta = AttentionMetadata(
            slot_mapping=torch.full((17,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(2, width, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([1, 16], dtype=torch.int32, device=dev),
            query_start_loc=None, query_lens=[1, 16], max_seq_len=16, is_decode=False,
            num_decode=1, decode_max_seq_len=1, prefill_seq_lens=[16])
        with torch.inference_mode():  # as the steps run it: no recompile for grad mode
            q = torch.zeros(17, probe.num_heads, k_cache.shape[3], dtype=probe.dtype,
                            device=dev)
            plan = self.prepare(meta, probe.kv_cache, probe.windows)
            assert isinstance(plan, FlexPlan)
            for w in dict.fromkeys(probe.windows):
                flex_mixed(q, probe.kv_cache, probe.scale, plan, w)

    def prepare(self, meta: AttentionMetadata, kv_cache: KVCache,
                windows: Sequence[int | None] = (None,)) -> FlexPlan | SdpaPlan:
        if not meta.is_mixed:
            return self.split.prepare(meta, kv_cache, windows)
        return prepare_flex(meta, kv_cache, list(dict.fromkeys(windows)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                plan: FlexPlan | SdpaPlan, scale: float, sliding_window: int | None = None
                ) -> torch.Tensor:
        if isinstance(plan, SdpaPlan):
            return self.split.forward(q, k, v, kv_cache, plan, scale, sliding_window)
        write_kv(k, v, kv_cache, plan.write_slots)
        return flex_mixed(q, kv_cache, scale, plan, sliding_window)


def prepare_flex(meta: AttentionMetadata, kv_cache: KVCache, windows: list[int | None]
                 ) -> FlexPlan:
    """A mixed forward's plan: its `num_decode` decode rows first, then its prefill rows with
    host-known lengths (`prefill_seq_lens`); nothing is read back."""
    from torch.nn.attention.flex_attention import BlockMask

    assert meta.query_lens is not None and meta.prefill_seq_lens is not None
    k_cache = kv_cache[0]
    num_blocks, block_size, device = k_cache.shape[0] - 1, k_cache.shape[1], k_cache.device
    n, q_lens = meta.num_decode, meta.query_lens
    width = max(1, min(-(-meta.decode_max_seq_len // block_size), meta.block_tables.shape[1]))
    ctx_blocks = [width] * n + [-(-s // block_size) for s in meta.prefill_seq_lens]
    tables = meta.block_tables.to(device=device, dtype=torch.int64)
    parts = [tables[:n, :width].reshape(-1)]
    parts += [tables[n + i, :b] for i, b in enumerate(ctx_blocks[n:])]
    kv_lens = np.asarray(ctx_blocks) * block_size
    kv_end = np.cumsum(kv_lens)
    kv_start = kv_end - kv_lens
    t = int(sum(q_lens))
    t_pad = -(-t // Q_BLOCK) * Q_BLOCK
    c = int(kv_end[-1])
    c_pad = -(-c // KV_BLOCK) * KV_BLOCK
    # Padding keys come from a real block (finite), belong to no row and are never seen.
    pad_blocks = (c_pad - c) // block_size + (1 if (c_pad - c) % block_size else 0)
    parts.append(torch.zeros(pad_blocks, dtype=torch.int64, device=device))
    gather_idx = torch.cat(parts).clamp_(0, num_blocks - 1)
    c_pad = int(gather_idx.shape[0]) * block_size
    row_ids = np.arange(len(q_lens))
    q_row = np.full(t_pad, -1, dtype=np.int64)
    q_row[:t] = np.repeat(row_ids, q_lens)
    kv_row = np.full(c_pad, -2, dtype=np.int64)
    kv_row[:c] = np.repeat(row_ids, kv_lens)
    kv_pos = np.zeros(c_pad, dtype=np.int64)
    kv_pos[:c] = np.arange(c) - np.repeat(kv_start, kv_lens)
    prefill_pos = [np.arange(s - q, s) for s, q in zip(meta.prefill_seq_lens, q_lens[n:],
                                                       strict=True)]
    # The last key each prefill query sees: itself, or the end of its image (Gemma 3).
    spans = meta.bidirectional or [[] for _ in prefill_pos]
    prefill_hi = [last_visible(p, s) for p, s in zip(prefill_pos, spans, strict=True)]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    decode_pos = meta.seq_lens[:n].to(device=device, dtype=torch.int64) - 1
    pad = torch.zeros(t_pad - t, dtype=torch.int64, device=device)
    q_pos = torch.cat((decode_pos, dev(np.concatenate([np.zeros(0, np.int64), *prefill_pos])),
                       pad))
    q_hi = q_pos if not meta.bidirectional else torch.cat(
        (decode_pos, dev(np.concatenate([np.zeros(0, np.int64), *prefill_hi])), pad))
    num_kv, indices = _kv_blocks(q_row[:t], kv_start, kv_end, t_pad, c_pad)
    q_row_t, kv_row_t, kv_pos_t = dev(q_row), dev(kv_row), dev(kv_pos)
    plan = FlexPlan(write_slots(meta.slot_mapping, kv_cache), gather_idx, t)
    for w in windows:
        mask_mod = _mask_mod(q_row_t, q_pos, q_hi, kv_row_t, kv_pos_t, w)
        plan.masks[w] = BlockMask.from_kv_blocks(
            dev(num_kv), dev(indices), BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod,
            seq_lengths=(t_pad, c_pad), compute_q_blocks=False)
    return plan


def _kv_blocks(q_row: np.ndarray, kv_start: np.ndarray, kv_end: np.ndarray, t_pad: int,
               c_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query block's KV blocks: the range its rows' contexts cover (rows are packed in
    the same order on both sides, so it is contiguous)."""
    num_q, num_kv = t_pad // Q_BLOCK, -(-c_pad // KV_BLOCK)
    counts = np.zeros((1, 1, num_q), dtype=np.int32)
    indices = np.zeros((1, 1, num_q, num_kv), dtype=np.int32)
    for qb in range(num_q):
        members = q_row[qb * Q_BLOCK:(qb + 1) * Q_BLOCK]
        if not len(members):
            continue
        lo = int(kv_start[members[0]]) // KV_BLOCK
        hi = -(-int(kv_end[members[-1]]) // KV_BLOCK)
        counts[0, 0, qb] = hi - lo
        indices[0, 0, qb, : hi - lo] = np.arange(lo, hi)
    return counts, indices


def _mask_mod(q_row: torch.Tensor, q_pos: torch.Tensor, q_hi: torch.Tensor,
              kv_row: torch.Tensor, kv_pos: torch.Tensor, window: int | None
              ) -> Callable[..., torch.Tensor]:
    """Same row, up to the query's last visible key (`q_hi`: its position, or its image's
    end), and inside the window behind its position."""

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        seen = (q_row[q_idx] == kv_row[kv_idx]) & (kv_pos[kv_idx] <= q_hi[q_idx])
        if window is not None:  # HF's convention: a query sees keys with q - k < window
            seen = seen & (kv_pos[kv_idx] > q_pos[q_idx] - window)
        return seen

    return mask_mod


def flex_mixed(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float,
               plan: FlexPlan, window: int | None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D], every row against its packed context."""
    k_cache, v_cache = kv_cache
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    c = int(plan.gather_idx.shape[0]) * k_cache.shape[1]
    kg = read_blocks(k_cache, plan.gather_idx, q.dtype).view(1, c, hkv, d)
    vg = read_blocks(v_cache, plan.gather_idx, q.dtype).view(1, c, hkv, d)
    t, hq = q.shape[0], q.shape[1]
    qp = F.pad(q, (0, 0, 0, 0, 0, -(-t // Q_BLOCK) * Q_BLOCK - t)).unsqueeze(0)
    out = _call(qp.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                plan.masks[window], scale, hq != hkv)
    return out[0].transpose(0, 1)[:t]


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float,
          gqa: bool) -> torch.Tensor:
    from torch.nn.attention import flex_attention as fa
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if q.device.type != "cuda" or _get_current_dispatch_mode() is not None:
        # Uncompiled (torch.compile refuses to run under the tests' host-sync guard): the
        # operator itself, every score materialised.  The CPU's run, never a GPU server's.
        debug, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = (
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, True)
        try:
            return fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                     enable_gqa=gqa)
        finally:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug
    options = {"BLOCK_M": Q_BLOCK, "BLOCK_N": KV_BLOCK, "FORCE_USE_FLEX_ATTENTION": True}
    return _compiled()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                       kernel_options=options)


@functools.cache
def _compiled() -> Callable[..., Any]:
    """The compiled operator, one per process (shape-dynamic: one compile serves every
    step; the backend's `warm_up` makes it happen at start-up)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)
