"""The flash backend: flash_attn 2 reads the paged cache directly, for every kind of forward
(decode: `flash_attn_with_kvcache`; prefill and mixed: one varlen call over every row).

It serves where flash_attn is installed with paged varlen (a `block_table` argument), on
CUDA, with a 16-bit model and cache (flash_attn 2 cannot read an fp8 cache) paged in
multiples of 256 tokens.  `auto` picks it first wherever it serves, unless
`--no-flash-attn` says not to.  A stock torch image has no flash_attn (it does not install
from wheels), so there mixed steps go to the flex backend.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import KVCache, write_kv, write_slots

try:  # pragma: no cover - not installed in the CPU test environment
    from flash_attn import flash_attn_varlen_func as _fa_varlen
    from flash_attn import flash_attn_with_kvcache as _fa_kvcache

    if "block_table" not in inspect.signature(_fa_varlen).parameters:
        raise ImportError("flash_attn too old: varlen without block_table")
    _MISSING = ""
except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA extension at import
    _fa_varlen = None
    _fa_kvcache = None
    _MISSING = f"flash_attn is not usable here ({type(exc).__name__}: {exc})"

# flash_attn 2.x only pages KV with block sizes that are multiples of this.
BLOCK_MULTIPLE = 256
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class FlashPlan:
    write_slots: torch.Tensor  # [T] int64, -1 redirected into the scratch block
    block_tables: torch.Tensor  # [S, width] int32
    seq_lens: torch.Tensor  # [S] int32
    max_seq_len: int
    is_decode: bool
    # prefill and mixed forwards (varlen)
    cu_seqlens_q: torch.Tensor | None = None  # [S + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [S + 1] int32
    max_query_len: int = 1
    num_tokens: int = 0  # real query tokens (rows past them are padding)


class FlashBackend(AttentionBackend):
    name = "flash"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int) -> str | None:
        if _fa_varlen is None:
            return _MISSING or "flash_attn is not installed"
        if device.type != "cuda":
            return f"flash_attn runs on CUDA only (device {device.type})"
        if dtype not in _HALF or kv_dtype not in _HALF:
            return (f"flash_attn needs a float16 or bfloat16 model and KV cache (model "
                    f"{str(dtype).removeprefix('torch.')}, cache "
                    f"{str(kv_dtype).removeprefix('torch.')})")
        if block_size % BLOCK_MULTIPLE:
            return f"flash_attn pages the cache in multiples of {BLOCK_MULTIPLE} tokens " \
                   f"(--block-size {block_size})"
        return None

    def prepare(self, meta: AttentionMetadata, kv_cache: KVCache,
                windows: Sequence[int | None] = (None,)) -> FlashPlan:
        plan = FlashPlan(write_slots(meta.slot_mapping, kv_cache),
                         meta.block_tables.to(torch.int32), meta.seq_lens.to(torch.int32),
                         meta.max_seq_len, meta.is_decode)
        if meta.is_decode:
            return plan
        assert meta.query_start_loc is not None and meta.query_lens is not None
        n_q = int(meta.query_start_loc.shape[0])  # shape only: no sync
        plan.cu_seqlens_q = meta.query_start_loc.to(torch.int32)
        plan.cu_seqlens_k = F.pad(torch.cumsum(plan.seq_lens, 0, dtype=torch.int32), (1, 0))
        plan.block_tables = plan.block_tables[: n_q - 1]
        plan.max_query_len = max(meta.query_lens or [1])
        plan.num_tokens = sum(meta.query_lens)
        return plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                plan: FlashPlan, scale: float, sliding_window: int | None = None
                ) -> torch.Tensor:  # pragma: no cover - needs flash_attn on CUDA
        write_kv(k, v, kv_cache, plan.write_slots)
        k_cache, v_cache = kv_cache
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if plan.is_decode:
            out: torch.Tensor = _fa_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=plan.seq_lens,
                block_table=plan.block_tables, softmax_scale=scale, causal=True,
                window_size=window)
            return out.squeeze(1)
        out = torch.zeros_like(q)
        t = plan.num_tokens
        out[:t] = _fa_varlen(
            q[:t], k_cache, v_cache, cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len, softmax_scale=scale, causal=True,
            window_size=window, block_table=plan.block_tables)
        return out
