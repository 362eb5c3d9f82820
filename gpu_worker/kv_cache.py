"""The paged KV cache: per layer a pair of tensors [num_blocks + 1, block_size, num_kv_heads,
head_dim].  Block ``num_blocks`` (the last one) is scratch: rows whose slot is -1 (masked
decode rows, padding) write there, so no host-side filtering is needed and real blocks are
never touched by them."""

from __future__ import annotations

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs across all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


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
