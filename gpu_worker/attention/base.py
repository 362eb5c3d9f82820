"""What every attention backend shares: the per-forward metadata and the backend interface.

A backend (`sdpa`, `flex`, `flash`; `registry` lists them and picks one at start-up) turns a
forward's `AttentionMetadata` into a plan once (`prepare`: masks, gather indices, redirected
slots, everything that depends on the metadata and not on the layer), then each layer calls
`forward` with that plan: write the layer's k/v into the paged cache
(`gpu_worker.attention.kv_cache` has its layout), then attend.  Each backend's plan is a
dataclass of its own holding only its fields.

A forward is one of three kinds: decode (one query token per row, ``is_decode``), prefill
(rows of host-known query lengths), or *mixed* (``num_decode > 0`` and not ``is_decode``):
its decode rows first, one query token each, then its prefill rows.  A mixed forward's decode
rows' context lengths exist only on the device (they advance there) and its prefill rows' are
known on the host too (``prefill_seq_lens``), so nothing in it reads the device.  Every
token's k/v is written before any row attends, so a decode row sees a prefill piece of its
own request from the same forward.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from tandem_serve.gpu_worker.attention.kv_cache import KVCache


@dataclass
class StateRows:
    """Hybrid models' recurrent-state slots of a forward's rows (`models.hybrid`): the decode
    rows' (device), then per prefill row its slot and whether it starts a sequence (its
    state starts from zeros rather than from the slot). A verify step's forward (speculative
    decoding) has B decode rows, then k draft rows for each of the rows `verify` names:
    (their batch rows [S] on the device, k)."""

    decode: torch.Tensor | None  # [B] int64
    prefill: list[int]
    fresh: list[bool]
    verify: tuple[torch.Tensor, int] | None = None
    # Prefix caching: per prefill row, the (offset in the row, block) after which it
    # checkpoints its state.
    marks: list[list[tuple[int, int]]] = field(default_factory=list)


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
    # Hybrid models: the rows' recurrent-state slots (None: a model without linear layers).
    states: StateRows | None = None
    # Gemma 3's images: per prefill row (after any decode rows), the [start, end) sequence
    # positions of the images it holds whole; a query inside one also sees that image's
    # later tokens (None: causal everywhere). `bidirectional_spans` reads it.
    bidirectional: list[list[tuple[int, int]]] | None = None

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
                                 prefill_seq_lens=self.prefill_seq_lens,
                                 bidirectional=self.bidirectional)


def last_visible(q_pos: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per query position, the last key position it sees before any window: itself, or the
    last token of the image it is in (transformers' Gemma 3 mask: causal OR same image)."""
    hi = q_pos.copy()
    for start, end in spans:
        hi[(q_pos >= start) & (q_pos < end)] = end - 1
    return hi


@dataclass(frozen=True)
class WarmUp:
    """What a backend's start-up check runs over: one layer's KV cache, the model's query
    heads per rank, its distinct sliding windows (None: full attention), the layers' scale
    and the compute dtype (`CausalLM.attention_warm_up`)."""

    kv_cache: KVCache
    num_heads: int
    windows: tuple[int | None, ...]
    scale: float
    dtype: torch.dtype


class AttentionBackend(ABC):
    """Attention over the paged KV cache.  One object serves the whole process: it is chosen
    and checked once at start-up (`registry.select_backend`), handed to the model, and holds
    no per-forward state (that is the plan's)."""

    # The `--attention-backend` value naming it (its key in `registry.BACKENDS`).
    name: ClassVar[str]
    # Whether its decode forward may be captured in a CUDA graph (no host read; shapes fixed
    # by host bounds): the runner records decode graphs only for such a backend.  Mixed
    # steps' attention always runs eagerly between the captured pieces
    # (`gpu_worker.graphs.piecewise`), so it needs no flag.
    decode_graphs: ClassVar[bool] = True
    # Whether its prefill honours `AttentionMetadata.bidirectional` (Gemma 3's images); a
    # model that needs it refuses a backend that does not, at start-up.
    bidirectional: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int) -> str | None:
        """None where it can serve a cache of `kv_dtype` paged in `block_size`s on `device`
        for a `dtype` model; else why not, in a few words (a start-up error quotes it)."""

    @classmethod
    def auto_skips(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                   block_size: int) -> str | None:
        """Why `--attention-backend auto` passes it over here (None: auto may pick it). By
        default only what `supports` refuses; a backend that works but is slower somewhere
        says so here, and stays available by name."""
        return cls.supports(device, dtype, kv_dtype, block_size)

    def warm_up(self, probe: WarmUp) -> None:
        """Start-up work that may fail (a kernel compile), so that a failure chooses another
        backend at start-up rather than mid-serving.  Must not change the cache's real
        blocks.  Nothing to do by default."""
        return None

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, kv_cache: KVCache,
                windows: Sequence[int | None] = (None,)) -> Any:
        """This backend's plan for a forward: what every layer shares.  `kv_cache` is any
        layer's cache (only its shape and device are read); `windows` lists the distinct
        sliding windows of the model's layers (None: full attention).  No host read for a
        decode or mixed forward (CUDA graphs capture the decode one)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                plan: Any, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Write k/v [T, Hkv, D] into the layer's cache, then attend causally: q [T, Hq, D]
        -> [T, Hq, D]; a query sees keys at positions p with q - p < `sliding_window`
        (and, where the backend is `bidirectional`, its image's later tokens)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
