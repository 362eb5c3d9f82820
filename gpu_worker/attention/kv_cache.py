"""The paged KV cache: per layer a pair of tensors [num_blocks + 1, block_size, num_kv_heads,
head_dim].  Block ``num_blocks`` (the last one) is scratch: rows whose slot is -1 (masked
decode rows, padding) write there, so no host-side filtering is needed and real blocks are
never touched by them.

The cache holds the model dtype, or fp8 (``--kv-cache-dtype fp8``: float8_e4m3fn, one byte
an element, so twice the blocks of bf16 in the same memory).  fp8 uses a per-tensor scale of
1.0, vLLM's default without calibrated scales: a value is stored as itself, clamped to
e4m3's ±448 (the cast itself would give NaN past it on some devices), and read back by a
plain cast to the compute dtype.  No scale is ever derived from the data, so an append never
has to requantize what a block already holds, and nothing is read back to the host.  What
e4m3 costs is its precision (3 mantissa bits: a relative error up to 1/16) and magnitudes
below 2**-9, which round to 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.models.config import ModelArgs

KVCache = tuple[torch.Tensor, torch.Tensor]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0

# --kv-cache-dtype's accepted values (`proto.config.KV_CACHE_DTYPES`); None: the model dtype.
CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a `--kv-cache-dtype` value."""
    if name not in CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of {', '.join(CACHE_DTYPES)}")
    return CACHE_DTYPES[name] or model_dtype


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs across all layers, K and V together (`dtype`: the cache's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def blocks_for(cfg: ModelArgs, block_size: int, dtype: torch.dtype, gib: float,
               max_num_seqs: int, max_model_len: int, extra_per_block: int = 0,
               fixed: int = 0) -> int:
    """How many blocks the cache gets: `gib` GiB of them, or (0) enough for every sequence
    slot at full length, capped at 4 GiB.  `extra_per_block`: bytes a block costs besides
    the model's own (a speculative draft model's cache mirrors every block); `fixed`: bytes
    the budget pays first (a hybrid model's recurrent states).  Only attention layers hold
    KV (a hybrid model's linear layers hold states instead)."""
    per_block = extra_per_block + kv_cache_bytes_per_block(
        cfg.num_attention_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)
    if gib > 0:
        return max(1, (int(gib * (1 << 30)) - fixed) // per_block)
    wanted = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(wanted, (4 << 30) // per_block))


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """Per layer (k_cache, v_cache), each [num_blocks + 1, block_size, num_kv_heads, head_dim].

    Zero-filled rather than empty: the SDPA path reads whole blocks and masks the tail, and a
    masked position still enters the PV product with weight 0; uninitialised memory holding
    NaN/inf would turn 0 * NaN into NaN.
    """
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def quantize(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] as attention reads it back from `cache` (through fp8 for an fp8 cache).

    A prefill that attends over its fresh k/v uses this, so every query sees the same keys
    whichever way its context arrived (fresh, chunked, a cached prefix, after preemption):
    the greedy tokens do not depend on how the scheduler cut the work."""
    return quantize(x).to(x.dtype) if is_fp8(cache) else x


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, Hkv, D] into the cache's token slots [T] (quantizing for an fp8 cache)."""
    hkv, d = cache.shape[2], cache.shape[3]
    if not is_fp8(cache):
        cache.view(-1, hkv, d).index_copy_(0, slots, x)
        return
    # index_copy_ has no float8 kernel on the CPU: copy the bytes.
    stored = cache.view(torch.uint8).view(-1, hkv, d)
    stored.index_copy_(0, slots, quantize(x).view(torch.uint8))


def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """Whole blocks [n, block_size * Hkv * D] in the compute `dtype` (dequantized from fp8:
    only the blocks read are converted, never the whole cache)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    return rows.to(dtype) if rows.dtype != dtype else rows


def write_slots(slot_mapping: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
    """A forward's slots [T] as int64 on the cache's device, -1 (do not write) redirected
    into the scratch block: computed once per forward, shared by every layer."""
    k_cache = kv_cache[0]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    return torch.where(slots >= 0, slots, (k_cache.shape[0] - 1) * k_cache.shape[1])


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots: torch.Tensor
             ) -> None:
    """Scatter a forward's k/v [T, Hkv, D] into their slots (`write_slots`)."""
    store_rows(kv_cache[0], slots, k)
    store_rows(kv_cache[1], slots, v)
