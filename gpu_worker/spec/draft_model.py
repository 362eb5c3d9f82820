"""Speculative decoding's `draft_model` method: a smaller checkpoint with the target's
tokenizer proposes each verify step's k drafts with k decode forwards of its own, on the
device, inside the plan (`gpu_worker.spec.verify` verifies them as it verifies n-gram drafts).
`DraftModel` is its `Proposer` (`gpu_worker.spec.proposer`), built by `load_draft`.

The draft is loaded by the target's loader, on its device and in its dtype, and has a paged
KV cache of its own that mirrors the target's block layout: the same block ids and block
tables index separate cache tensors shaped for the draft's layers and heads.  So the
scheduler needs no change; each KV block simply costs the target's bytes plus the draft's
(`kv_bytes_per_block`, counted where the worker sizes its cache from memory).

The draft's cache holds each request's positions [0, `draft_len`).  Before a plan in which
a request speculates, the draft prefills what it misses of its history (`catch_up`: the
prompt the first time, and the tokens of plans in which the request did not speculate), in
one forward at the plan's start.  A verify step's first draft forward feeds two rows per
request: the previous token at p - 1 and the input token at p.  When a step accepted all k
drafts, the last one's KV is not in the draft's cache (no draft forward consumed it), and the
p - 1 row writes it; otherwise it rewrites a correct entry, which is harmless.  The next
k - 1 forwards each feed the last draft, so after a plan the cache holds every position but
the last (`draft_len` = history - 2).  KV of rejected drafts is overwritten once real tokens
reach those positions.  A preempted request starts again from 0 (`preempted`).  What the
draft's cache holds only moves the acceptance rate, never the output: every draft is
verified.

Every row's drafts are the draft's argmax, sampled rows' too: a verify position is sampled
exactly as a plain step samples it and a draft is kept iff it equals that sample (the
one-hot rule of `gpu_worker.spec.batch`), which keeps the target's distribution whatever the
draft proposes; the argmax is the draft's best guess of that sample.  No host reads: the
forwards take host bounds the plan already knows (`DecodeBatch.max_seq_len`, `row_lens`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import (
    KVCache,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
)
from tandem_serve.gpu_worker.models.loader import load_model
from tandem_serve.gpu_worker.spec.proposer import DraftInputs, Proposer, ProposerContext, Timed
from tandem_serve.gpu_worker.spec.step_cost import decode_timer
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.gpu_worker.steps import Piece, prefill_inputs, prefill_metadata
from tandem_serve.proto.speculative import SpeculativeConfig

log = logging.getLogger(__name__)


class DraftModel(Proposer):
    """The draft checkpoint and its KV cache (allocated once the block count is known)."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device,
                 onednn: bool, load_format: str) -> None:
        t0 = time.monotonic()
        self.model = load_model(model_dir, dtype, device, onednn, load_format=load_format)
        cfg = self.model.config
        log.info("draft model loaded in %.2f s (%s, %d layers)", time.monotonic() - t0,
                 cfg.architecture, cfg.num_layers)
        self.device = device
        self.caches: list[KVCache] = []
        self.block_size = 0

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = self.model.config
        return kv_cache_bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                        block_size, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 attention: AttentionBackend) -> None:
        """The draft's cache: as many blocks as the target's, the same ids; it attends with
        the target's backend (`attention`, chosen at start-up for the same device, dtype,
        cache type and block size; the draft runs decode and prefill forwards only)."""
        cfg = self.model.config
        self.model.attention = attention
        self.block_size = block_size
        self.caches = allocate_kv_cache(cfg.num_layers, num_blocks, block_size,
                                        cfg.num_kv_heads, cfg.head_dim, kv_dtype, self.device)
        log.info("draft KV cache: %.1f MiB",
                 sum(t.nbytes for kv in self.caches for t in kv) / 2**20)

    def start_plan(self, reqs: list[RequestState]) -> None:
        self.catch_up(reqs)

    def end_plan(self, reqs: list[RequestState]) -> None:
        """The plan's steps wrote every position but the last (the module doc)."""
        for r in reqs:
            r.draft_len = max(r.draft_len, len(r.history) - 2)

    def preempted(self, req: RequestState) -> None:
        req.draft_len = 0

    @torch.inference_mode()
    def catch_up(self, reqs: list[RequestState]) -> None:
        """Before a plan in which `reqs` speculate: each one's history up to the token
        before its input into the draft's cache, from what the cache holds
        (`RequestState.draft_len`), in one prefill forward (host work, before the steps)."""
        pieces = []
        for r in reqs:
            end = min(len(r.history) - 2, len(r.block_ids) * self.block_size)
            if r.draft_len < end:
                pieces.append(Piece(r, r.draft_len, end - r.draft_len))
        if pieces:
            inp = prefill_inputs(pieces, self.block_size, self.device,
                                 history_lens=self.model.uses_history_lens, score=False)
            self.model(inp.ids, inp.positions, self.caches, prefill_metadata(inp), None,
                       inp.history_lens)
        for p in pieces:
            p.req.draft_len = p.start + p.count

    def step_cost(self, k: int, timed: Timed) -> Callable[[int], float]:
        """A verify step's k draft forwards for S rows: 2 rows per request, then 1, each
        timed as one decode forward of the draft over n masked rows."""
        one = timed(decode_timer(self.logits, self.device, 256, self.block_size))

        def cost(rows: int) -> float:
            return one(2 * rows) + (k - 1) * one(rows)
        return cost

    def logits(self, ids: Tensor, positions: Tensor, active: Tensor, tables: Tensor,
               bound: int, row_lens: list[int], last_of: int = 1) -> Tensor:
        """One decode forward of the draft; logits of every `last_of`-th row (the last of
        each group).  Inactive rows write the scratch block only."""
        bs = self.block_size
        index = (positions // bs).clamp(max=tables.shape[1] - 1).unsqueeze(1)
        block = tables.gather(1, index).squeeze(1).to(torch.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.where(active, block * bs + positions % bs, -1),
            block_tables=tables,
            # Rows joining later in the plan may sit past the bound (their output is unused).
            seq_lens=(positions + 1).clamp(max=bound).to(torch.int32), query_start_loc=None,
            query_lens=None, max_seq_len=bound, is_decode=True, decode_lens=row_lens)
        hidden = self.model(ids, positions, self.caches, meta)
        return self.model.compute_logits(hidden[last_of - 1::last_of])

    @torch.inference_mode()
    def propose(self, rows: DraftInputs) -> tuple[Tensor, Tensor]:
        """Drafts [S, k] of the speculating rows (each the draft's argmax) and how many of
        them each may use [S]: positions past the row's KV blocks are neither written nor
        drafted."""
        assert self.caches, "a verify step with the draft's cache"
        k, capacity = rows.k, rows.capacity
        pos, ids, tables = rows.positions, rows.input_ids, rows.block_tables
        bound, lens = rows.bound, rows.lens
        # The previous token (its KV may be missing: the module doc) and the input token.
        prev = rows.history.gather(1, (pos - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        active = rows.active
        first = active & (pos < capacity)
        tok = self.logits(
            torch.stack((prev.clamp(min=0), ids), dim=1).reshape(-1),
            torch.stack(((pos - 1).clamp(min=0), pos), dim=1).reshape(-1),
            torch.stack((first & (pos >= 1), first), dim=1).reshape(-1),
            tables.repeat_interleave(2, dim=0), bound,
            [n for n in lens for _ in range(2)], last_of=2).argmax(dim=-1)
        drafts = [tok]
        for j in range(1, k):
            at = pos + j
            ok = active & (at < capacity)
            tok = self.logits(tok, torch.where(ok, at, pos), ok, tables, bound,
                              lens).argmax(dim=-1)
            drafts.append(tok)
        # Draft j came from the forward at pos + j - 1: usable where that one wrote its KV.
        length = (capacity - pos).clamp(min=0, max=k)
        return torch.stack(drafts, dim=1), length


def load_draft(config: SpeculativeConfig, ctx: ProposerContext) -> DraftModel:
    """The registry's factory for method `draft_model`: a checkpoint the loader cannot use,
    or whose vocabulary is not the target's, is a ValueError naming the draft."""
    try:
        draft = DraftModel(config.model, ctx.dtype, ctx.device, ctx.onednn, ctx.load_format)
    except ValueError as exc:
        raise ValueError(f"draft model {config.model!r}: {exc}") from exc
    if draft.model.config.vocab_size != ctx.vocab_size:
        raise ValueError(f"draft model {config.model!r} has vocab_size "
                         f"{draft.model.config.vocab_size}, the target {ctx.vocab_size}")
    return draft
