"""The Triton backend: one kernel family (`triton_kernels.unified_attention`) for every kind
of forward — decode rows, speculative verify rows and a mixed step's prefill pieces — reading
K/V through the block table in place.

Where the SDPA path copies each row's context out of the cache every layer (about three
times the context's bytes, padded to the longest row), this reads each key once, straight
from its block, with an online softmax; few rows with long contexts split their keys over
more programs (flash-decoding).  It is what vLLM runs when flash_attn is absent.  The grid
depends on the forward's shapes and host bounds only and lengths are read on the device, so
decode steps are captured in CUDA graphs like every other backend's.

It serves CUDA devices where Triton is installed.  On the CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which the tests use to run the very kernel a GPU runs;
`auto` never picks it there.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata, WarmUp
from tandem_serve.gpu_worker.attention.kv_cache import KVCache, write_kv, write_slots

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class TritonPlan:
    write_slots: torch.Tensor  # [T] int64, -1 redirected into the scratch block
    rows: Any  # triton_kernels.PagedRows: every layer's kernel reads the same rows


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        # Imported here, not with the registry: Triton decorates the kernels at import, and
        # reads TRITON_INTERPRET then (the CPU path never loads Triton at all).
        from tandem_serve.gpu_worker.attention import triton_kernels

        self.kernels: ModuleType = triton_kernels

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device.type != "cuda" and not _interpreted():
            return (f"Triton kernels run on CUDA (device {device.type}; on the CPU only under "
                    "TRITON_INTERPRET=1, for tests)")
        if dtype not in _DTYPES:
            return f"no Triton path for a {str(dtype).removeprefix('torch.')} model"
        return None

    @classmethod
    def auto_skips(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                   block_size: int) -> str | None:
        if device.type != "cuda":
            return "the interpreter is for tests: far slower than sdpa on the CPU"
        return cls.supports(device, dtype, kv_dtype, block_size)

    def warm_up(self, probe: WarmUp) -> None:
        """Compile the kernels now for the query tiles serving uses (a decode row, verify
        rows, prefill pieces from a few tokens to hundreds) and every window: a compile in
        the first mixed or verify step would stall every stream.  Reads the cache (block 0),
        writes nothing.  The decode graphs' captures compile the split-KV variants."""
        k_cache = probe.kv_cache[0]
        dev = k_cache.device
        for q_len in (1, 2, 4, 8, 16, 32, 64):
            blocks = -(-q_len // k_cache.shape[1])
            tables = torch.zeros(1, blocks, dtype=torch.int32, device=dev)
            lens = torch.full((1,), q_len, dtype=torch.int32, device=dev)
            starts = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
            rows = self.kernels.PagedRows(tables, lens, starts, q_len, q_len, 1)
            q = torch.zeros(q_len, probe.num_heads, k_cache.shape[3], dtype=probe.dtype,
                            device=dev)
            with torch.inference_mode():
                for w in dict.fromkeys(probe.windows):
                    self.kernels.unified_attention(q, probe.kv_cache, rows, probe.scale, w)

    def prepare(self, meta: AttentionMetadata, kv_cache: KVCache,
                windows: Sequence[int | None] = (None,)) -> TritonPlan:
        k_cache = kv_cache[0]
        device, block_size = k_cache.device, k_cache.shape[1]
        # Pad entries may be anything (-1, garbage): a masked row's reads land on a real
        # block, never outside the cache, and a row never reads past its table.
        tables = meta.block_tables.to(device=device, dtype=torch.int32).clamp(
            0, k_cache.shape[0] - 1)
        rows = tables.shape[0]
        seq_lens = meta.seq_lens.to(device=device, dtype=torch.int32).clamp(
            max=tables.shape[1] * block_size)
        if meta.is_decode:
            starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
            max_query_len = 1
        else:
            assert meta.query_lens is not None, "a prefill or mixed forward has query lengths"
            bounds = [0]
            for n in meta.query_lens:
                bounds.append(bounds[-1] + n)
            starts = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
            max_query_len = max(meta.query_lens, default=1)
        paged = self.kernels.PagedRows(tables, seq_lens, starts, max_query_len,
                                       meta.max_seq_len)
        return TritonPlan(write_slots(meta.slot_mapping, kv_cache), paged)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                plan: TritonPlan, scale: float, sliding_window: int | None = None
                ) -> torch.Tensor:
        write_kv(k, v, kv_cache, plan.write_slots)
        out: torch.Tensor = self.kernels.unified_attention(q, kv_cache, plan.rows, scale,
                                                           sliding_window)
        return out
