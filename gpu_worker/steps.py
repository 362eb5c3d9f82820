"""A plan's steps: which prefill chunk pieces each of its K steps carries, when each request
starts decoding, and the device inputs of those pieces.

A step is one forward over every decoding row (one token each) and the prefill pieces the
plan put in it (`StepPlan` has the message's rule), so a decoding row waits for a step's
share of a prompt, never for a whole one.  A request whose last piece runs in step s has a
decode row from step s on: that row reads the piece's KV, which the same forward wrote
before any row attends, and samples the first token on the device.  Before step s the row is
in the decode batch but masked (`DecodeBatch.joins`), so the batch keeps one shape for the
whole plan.

Everything here is host work done once per plan, before the K-step loop: the loop then
only launches forwards over inputs already on the device and reads nothing back.  Two plans
run their chunks in one forward of their own before the steps instead (`Layout.separate`):
the `--prefill-phase` baseline, and a plan with no decode row at all, which has no steps.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention.base import AttentionMetadata, StateRows
from tandem_serve.gpu_worker.constrain.tables import batch_order
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.sampling import prompt_logprobs
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.ipc.tracing import TRACER

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.lora import LoraContext


def attention_tokens(cfg: ModelArgs) -> int:
    """The context length at which a prefill token's attention (two multiply-adds per key,
    head dimension and query head) costs what its linear layers do; the scheduler weighs a
    piece's tokens by it (`scheduler.budget`).  Both scale alike under tensor parallelism.
    On the CPU the measured figure for the tiny default model is within 20% of this ratio
    of multiply-adds (1,160 against 1,416 tokens)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    linear = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * i
    return max(1, linear // (2 * cfg.num_heads * d))


@dataclass
class Piece:
    """Tokens [start, start + count) of a request's history, computed in one forward."""

    req: RequestState
    start: int
    count: int


@dataclass
class Layout:
    """How a plan's work lies over its steps (host only)."""

    steps: list[list[Piece]]  # per step; in a step, rows ordered by adapter slot
    separate: list[Piece]  # run as one forward before the steps (then `steps` are empty)
    decoding: list[RequestState]  # the decode batch's rows, in batch order
    join_steps: list[int]  # per decoding row: the step it starts decoding in

    @property
    def num_prefill(self) -> int:
        return sum(p.count for pieces in (self.separate, *self.steps) for p in pieces)


def by_slot(req: RequestState) -> int:
    return req.lora_slot


def lay_out(requests: Iterable[RequestState], num_steps: int, prefill_phase: bool) -> Layout:
    """Place the plan's chunks into its steps and advance each request's computed count
    past its chunk (the forwards that compute it all run in this plan)."""
    live = sorted((r for r in requests if not r.finished), key=by_slot)
    steps: list[list[Piece]] = [[] for _ in range(num_steps)]
    joins: dict[int, int] = {}
    for r in live:
        pieces = r.prefill_steps or [r.prefill_chunk]
        if len(pieces) > num_steps or sum(pieces) != r.prefill_chunk:
            raise ValueError(f"request {r.request_id}: prefill steps {pieces} do not split a "
                             f"chunk of {r.prefill_chunk} over {num_steps} steps")
        at = r.num_computed
        for s, n in enumerate(pieces):
            if n:
                steps[s].append(Piece(r, at, n))
                at += n
        if at > len(r.history) - 1:
            raise ValueError(f"prefill past the last token of {r.request_id}")
        if at == len(r.history) - 1:  # decodes in this plan, from its last piece's step
            joins[r.request_id] = len(pieces) - 1
        r.num_computed, r.prefill_chunk, r.prefill_steps = at, 0, []
    # Guided rows grouped by constraint; within each group (and among the rest) rows of one
    # adapter are adjacent, so LoRA runs each adapter's rows as few segments.
    decoding = batch_order([r for r in live if r.request_id in joins])
    join_steps = [joins[r.request_id] for r in decoding]
    if not prefill_phase and decoding:
        return Layout(steps, [], decoding, join_steps)
    merged: dict[int, Piece] = {}  # one piece per request: its pieces are consecutive
    for p in (p for pieces in steps for p in pieces):
        first = merged.setdefault(p.req.request_id, Piece(p.req, p.start, 0))
        first.count += p.count
    separate = sorted(merged.values(), key=lambda p: by_slot(p.req))
    return Layout([[] for _ in steps], separate, decoding, [0] * len(decoding))


@dataclass
class PrefillInputs:
    """One forward's prefill tokens on the device, and what the host knows of their rows."""

    ids: torch.Tensor  # [P] int64
    positions: torch.Tensor  # [P] int64
    slots: torch.Tensor  # [P] int64 cache slots
    block_tables: torch.Tensor  # [n, width] int32
    seq_lens: torch.Tensor  # [n] int32: context after this forward
    query_start_loc: torch.Tensor  # [num_decode + n + 1] int32, the decode rows' first
    query_lens: list[int]
    seq_lens_host: list[int]
    token_slots: list[int]  # each token's adapter slot
    scores: prompt_logprobs.ScoreRows  # rows (of these P) whose prompt logprobs are asked for
    lora: LoraContext | None = None  # a mixed step's adapter rows: decode rows, then these
    # LongRoPE: each token's request's history length (`LlamaModel.uses_history_lens`).
    history_lens: torch.Tensor | None = None
    # A VL model's image embeddings: (rows among these P tokens, their values [1 + DeepStack
    # levels, rows, hidden]); set, with M-RoPE positions [3, P], by `gpu_worker.vision`.
    mm: tuple[torch.Tensor, torch.Tensor] | None = None
    # Gemma 3: per piece, the [start, end) positions of the images it holds (whole), whose
    # tokens attend to each other both ways; set by `gpu_worker.vision` (None: causal).
    bidirectional: list[list[tuple[int, int]]] | None = None
    # Hybrid models: each row's recurrent-state slot, and whether it starts its sequence.
    state_slots: list[int] = field(default_factory=list)
    state_fresh: list[bool] = field(default_factory=list)
    state_marks: list[list[tuple[int, int]]] = field(default_factory=list)

    def states(self, decode: StateRows | None = None) -> StateRows | None:
        """The rows' state slots for the metadata (after the `decode` rows'), if the model
        has linear layers (its requests hold slots)."""
        if not self.state_slots or self.state_slots[0] < 0:
            return None
        return StateRows(decode.decode if decode else None, self.state_slots, self.state_fresh,
                         decode.verify if decode else None, self.state_marks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_slots)


def prefill_inputs(pieces: list[Piece], block_size: int, device: torch.device,
                   num_decode: int = 0, min_width: int = 0,
                   history_lens: bool = False, score: bool = True, state_span: int = 0
                   ) -> PrefillInputs:
    """The device inputs of `pieces`; `num_decode` decode rows come first in the forward
    (their query offsets lead `query_start_loc`), and the block table is at least
    `min_width` wide (the decode rows' width, so both stack).  `history_lens`: also each
    token's request's history length (a LongRoPE model picks its factors by it).  `score`:
    pick the rows whose prompt logprobs are asked for (and count them as sent); False for a
    forward whose logits nobody reads (a speculative draft's).  `state_span`: a hybrid
    model's state checkpoints every this many tokens (0: none)."""
    ids: list[int] = []
    slots: list[np.ndarray] = []
    token_slots: list[int] = []
    lens = [p.count for p in pieces]
    width = max([min_width] + [len(p.req.block_ids) for p in pieces])
    table = np.zeros((len(pieces), width), dtype=np.int32)
    for i, p in enumerate(pieces):
        end = p.start + p.count
        ids += p.req.history[p.start:end]
        token_slots += [p.req.lora_slot] * p.count
        pos = np.arange(p.start, end)
        blocks = np.asarray(p.req.block_ids, dtype=np.int64)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        table[i, : len(p.req.block_ids)] = p.req.block_ids
    positions = np.concatenate([np.arange(p.start, p.start + p.count) for p in pieces])
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    query_start = np.concatenate([np.arange(num_decode), num_decode + offsets])
    seq_lens = [p.start + p.count for p in pieces]

    def dev(values: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values)).to(dtype).to(device, non_blocking=True)

    scores = (prompt_logprobs.select_rows([p.req for p in pieces], [p.start for p in pieces],
                                          offsets[:-1].tolist(), lens)
              if score else prompt_logprobs.ScoreRows())
    return PrefillInputs(
        ids=dev(ids, torch.int64), positions=dev(positions, torch.int64),
        slots=dev(np.concatenate(slots), torch.int64), block_tables=dev(table, torch.int32),
        seq_lens=dev(seq_lens, torch.int32), query_start_loc=dev(query_start, torch.int32),
        query_lens=lens, seq_lens_host=seq_lens, token_slots=token_slots,
        scores=scores.to(device),
        history_lens=dev(np.repeat([len(p.req.history) for p in pieces], lens), torch.int64)
        if history_lens else None,
        state_slots=[p.req.state_slot for p in pieces], state_fresh=[p.start == 0 for p in pieces],
        state_marks=[_marks(p, block_size, state_span) for p in pieces])


def _marks(p: Piece, block_size: int, span: int) -> list[tuple[int, int]]:
    """Where a piece passes a checkpoint boundary (every `span` tokens): the offset in the
    piece after which its state is saved, and the block that position ends."""
    if not span:
        return []
    first = (p.start // span + 1) * span
    return [(end - p.start, p.req.block_ids[(end - 1) // block_size])
            for end in range(first, p.start + p.count + 1, span)]


def prefill_metadata(inp: PrefillInputs) -> AttentionMetadata:
    """A forward of prefill pieces alone."""
    return AttentionMetadata(
        slot_mapping=inp.slots, block_tables=inp.block_tables, seq_lens=inp.seq_lens,
        query_start_loc=inp.query_start_loc, query_lens=inp.query_lens,
        max_seq_len=max(inp.seq_lens_host), is_decode=False,
        prefill_seq_lens=inp.seq_lens_host, states=inp.states(),
        bidirectional=inp.bidirectional)


def mixed_metadata(decode_slots: torch.Tensor, decode_positions: torch.Tensor,
                   decode_tables: torch.Tensor, max_decode_len: int,
                   inp: PrefillInputs, decode_states: StateRows | None = None
                   ) -> AttentionMetadata:
    """A step's forward: the decode rows (one token each, lengths on the device only) and
    then `inp`'s prefill rows."""
    n = decode_slots.shape[0]
    pad = inp.block_tables.shape[1] - decode_tables.shape[1]
    tables = F.pad(decode_tables, (0, pad)) if pad > 0 else decode_tables
    return AttentionMetadata(
        slot_mapping=torch.cat((decode_slots, inp.slots)),
        block_tables=torch.cat((tables, inp.block_tables)),
        # Rows that join later in the plan may sit past the bound: their output is discarded,
        # and no kernel may read further than the bound it was given.
        seq_lens=torch.cat(((decode_positions + 1).clamp(max=max_decode_len).to(torch.int32),
                            inp.seq_lens)),
        query_start_loc=inp.query_start_loc, query_lens=[1] * n + inp.query_lens,
        max_seq_len=max(max_decode_len, *inp.seq_lens_host), is_decode=False,
        num_decode=n, decode_max_seq_len=max_decode_len, prefill_seq_lens=inp.seq_lens_host,
        states=inp.states(decode_states), bidirectional=inp.bidirectional)


@dataclass
class StepWork:
    """What the K-step loop needs per step besides the decode batch."""

    pieces: list[list[Piece]]  # each step's prefill pieces (empty: decode only)
    join_steps: list[int]  # per decode row, the step it starts decoding in
    build: Callable[[list[Piece]], PrefillInputs]  # a step's pieces onto the device

    def inputs(self, plan_id: int, step: int) -> PrefillInputs | None:
        """Step `step`'s prefill inputs, built just before it (host work and copies to the
        device, no read back) rather than all at the plan's start, where they would lengthen
        one inter-token gap by all of them; the profiler sees a `prefill` span and the
        step's decode rows and prefill tokens (counters)."""
        pieces = self.pieces[step]
        pre = None
        if pieces:
            with TRACER.span("prefill", plan_id, step):
                pre = self.build(pieces)
        if TRACER.enabled:
            TRACER.counter("decode_rows", sum(1 for s in self.join_steps if s <= step))
            TRACER.counter("prefill_tokens", pre.num_tokens if pre is not None else 0)
        return pre
