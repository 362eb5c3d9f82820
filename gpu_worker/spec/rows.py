"""What a speculating row's draft positions need from the tokens before them: penalty tables
and guided-decoding states along the draft path, all on the device.

Draft position j of a row (1..k) samples the token after drafts d1..dj, and only matters if
they are all accepted, so it is sampled as a plain step would sample it after those tokens:

* penalties: the row's seen set and output counts plus d1..dj (`seen`, `counts`);
* guided tables: the automaton's state after d1..dj, one table lookup per draft from the
  row's state at the step's start, and the mask of that state.  A draft the automaton
  forbids at j cannot equal the token sampled at j - 1 (that one was masked), so it is
  rejected there and the positions after it never count (their state is DONE, harmless).

After acceptance the row's state is the path's state at its last emitted token, stepped
past that token, and the penalty tables take the emitted tokens after the first (the
runner's record step takes the first, as for every row).  Grammar rows (host matchers)
and guided rows held by min_new_tokens do not speculate (`gpu_worker.spec.batch.eligible`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem_serve.gpu_worker.batch import DecodeBatch
from tandem_serve.gpu_worker.constrain.tables import DeviceTable
from tandem_serve.gpu_worker.spec.batch import SpecBatch


@dataclass
class _Path:
    """One table's speculating rows: batch rows, their places among the speculating rows,
    and their states after 0..k drafts [G, 1 + k]."""

    table: DeviceTable
    rows: Tensor
    places: Tensor
    states: Tensor


@dataclass
class DraftContext:
    """The draft positions' penalty tables ([S * k, V], row-major by speculating row) and
    guided paths, for one verify step."""

    seen: Tensor | None = None
    counts: Tensor | None = None
    paths: list[_Path] = field(default_factory=list)

    def mask_(self, logits: Tensor, k: int) -> None:
        """-inf on every token a draft position's guided state forbids (logits [S * k, V])."""
        for p in self.paths:
            t = p.table
            bad = t.next_state.index_select(0, p.states[:, 1:].reshape(-1)) < 0
            bias = torch.where(bad, float("-inf"), 0.0)
            bias = bias.gather(1, t.token_class.expand(bias.shape[0], -1))
            at = (p.places.unsqueeze(1) * k + torch.arange(k, device=logits.device)).reshape(-1)
            logits.index_add_(0, at, bias)


def _vocab(b: DecodeBatch) -> int:
    table = b.sampling.seen if b.sampling.seen is not None else b.sampling.counts
    assert table is not None, "no penalty tables"
    return int(table.shape[1])


def _step(t: DeviceTable, states: Tensor, tokens: Tensor) -> Tensor:
    """Each state past its token (a forbidden one ends in DONE)."""
    cls = t.token_class.index_select(0, tokens.clamp(min=0))
    nxt = t.flat.index_select(0, states.to(torch.int64) * t.num_classes + cls)
    return torch.where(nxt >= 0, nxt, t.num_states)


def draft_context(b: DecodeBatch, spec: SpecBatch, drafts: Tensor, length: Tensor
                  ) -> DraftContext:
    """Before sampling: the tables and states of the draft positions (drafts [S, k])."""
    ctx = DraftContext()
    k = spec.k
    if b.sampling.seen is not None or b.sampling.counts is not None:
        j = torch.arange(k, device=drafts.device).unsqueeze(0)
        valid = (j < length.unsqueeze(1)).to(torch.float32)
        vocab = _vocab(b)
        # Position j (1..k) has seen d1..dj: a running sum of the drafts' one-hot rows.
        hot = torch.zeros(len(spec.chosen), k, vocab, device=drafts.device)
        hot.scatter_(2, drafts.clamp(min=0).unsqueeze(2), valid.unsqueeze(2))
        added = hot.cumsum(dim=1).reshape(-1, vocab)
        if b.sampling.seen is not None:
            ctx.seen = b.sampling.seen[spec.index].repeat_interleave(k, dim=0) | (added > 0)
        if b.sampling.counts is not None:
            ctx.counts = b.sampling.counts[spec.index].repeat_interleave(k, dim=0) + added
    if b.guided is not None:
        for g in b.guided.groups:
            places = [s for s, i in enumerate(spec.chosen) if g.lo <= i < g.hi]
            if not places:
                continue
            at = torch.tensor(places, device=drafts.device)
            rows = spec.index[at]
            states = [b.guided.state[rows].to(torch.int64)]
            for d in range(k):
                states.append(_step(g.table, states[-1], drafts[at, d]))
            ctx.paths.append(_Path(g.table, rows, at, torch.stack(states, dim=1)))
    return ctx


def advance_(b: DecodeBatch, spec: SpecBatch, ctx: DraftContext, emitted: Tensor,
             count: Tensor) -> None:
    """After the runner recorded each row's first emitted token: the speculating rows'
    guided states past their whole run, and their later tokens into the penalty tables
    (emitted [B, 1 + k], -1 past each run)."""
    for p in ctx.paths:
        assert b.guided is not None
        n = count[p.rows]
        last = (n - 1).clamp(min=0)
        before = p.states.gather(1, last.unsqueeze(1)).squeeze(1)
        token = emitted[p.rows].gather(1, last.unsqueeze(1)).squeeze(1)
        state = b.guided.state
        state.index_copy_(0, p.rows, torch.where(n > 0, _step(p.table, before, token),
                                                  state[p.rows].to(torch.int64)
                                                  ).to(state.dtype))
    later = emitted[spec.index, 1:]
    cols = later.clamp(min=0)
    kept = later >= 0
    if b.sampling.seen is None and b.sampling.counts is None:
        return
    vocab = _vocab(b)
    # One-hot sums (a token may come twice in a run; a -1 adds 0 to column 0).
    added = torch.zeros(len(spec.chosen), vocab, device=emitted.device)
    added.scatter_add_(1, cols, kept.to(added.dtype))
    if b.sampling.seen is not None:
        b.sampling.seen.index_copy_(0, spec.index, b.sampling.seen[spec.index] | (added > 0))
    if b.sampling.counts is not None:
        b.sampling.counts.index_copy_(0, spec.index, b.sampling.counts[spec.index] + added)
