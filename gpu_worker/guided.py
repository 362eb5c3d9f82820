"""Guided decoding on the gpu worker: constraint tables on the device, and per plan the
masks and state advances of the guided rows of the decode batch.

A `GuidedTable` (regex, choice, JSON schema) is uploaded once, when a plan first sends it,
and stays until a plan drops its id.  Each plan then packs its guided rows by table, with
static shapes (row lists, a [B] state vector and a [B, V] mask buffer fixed for the plan), so
that every one of the K steps is a fixed sequence of device ops with no host read:

    blocked[row] = next_state[state[row]][token_class] < 0        (before the sampler's draw)
    state[row]   = next_state[state[row], token_class[token]]     (after it)

A state only the host knows between plans: `_collect` reads the [B] state vector back with
the plan's tokens, and a resumed (preempted) request replays its kept output through the
table on the host.  Grammar rows (`gpu_worker/grammar.py`) share the mask buffer; their mask
comes from llguidance on the host, one step behind.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpu_worker.batch import RequestState
from gpu_worker.grammar import GrammarRegistry, GrammarRows
from proto.messages import GuidedGrammar, GuidedKind, GuidedTable


@dataclass
class DeviceTable:
    """One table, on the device and (for replays after preemption) on the host."""

    next_state: Tensor  # int32 [S + 1, C]
    flat: Tensor  # the same, flattened: next state of (state, class) at state * C + class
    token_class: Tensor  # int32 [V]
    host: GuidedTable

    @property
    def num_states(self) -> int:  # S: the DONE row's index
        return int(self.host.next_state.shape[0]) - 1

    @property
    def num_classes(self) -> int:
        return int(self.host.next_state.shape[1])

    def replay(self, tokens: list[int]) -> int:
        """The state after `tokens` from the initial state (host-side, for resumes)."""
        state = self.host.initial_state
        next_state, token_class = self.host.next_state, self.host.token_class
        for tok in tokens:
            nxt = int(next_state[state, token_class[tok]])
            state = nxt if nxt >= 0 else self.num_states  # never sampled; end the constraint
        return state


class GuidedRegistry:
    """The constraints a scheduler has sent and not yet dropped, by id."""

    def __init__(self, device: torch.device, vocab_size: int, model_dir: str) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.tables: dict[str, DeviceTable] = {}
        self.grammars = GrammarRegistry(model_dir, vocab_size, device)

    def apply(self, add: list[GuidedTable | GuidedGrammar], drop: list[str]) -> None:
        for table_id in drop:
            self.tables.pop(table_id, None)
            self.grammars.drop(table_id)
        for item in add:
            if isinstance(item, GuidedTable):
                self.tables[item.table_id] = self._upload(item)
            else:
                self.grammars.add(item)

    def _upload(self, t: GuidedTable) -> DeviceTable:
        if t.token_class.shape != (self.vocab_size,):
            raise ValueError(f"guided table {t.table_id}: token_class has shape "
                             f"{t.token_class.shape}, the model's vocab_size is {self.vocab_size}")
        # Copies: a decoded message's arrays are read-only views of its frames.
        nxt = torch.tensor(np.asarray(t.next_state, dtype=np.int32), device=self.device)
        cls = torch.tensor(np.asarray(t.token_class, dtype=np.int32), device=self.device)
        return DeviceTable(nxt, nxt.view(-1), cls, t)

    def table(self, table_id: str) -> DeviceTable:
        table = self.tables.get(table_id)
        if table is None:
            raise KeyError(f"guided table {table_id} is not at the worker: a plan must send it "
                           f"before a request that uses it decodes")
        return table

    # ---------------------------------------------------------------- per request

    def start(self, req: RequestState) -> None:
        """A request's constraint state from its kept output: fresh, or resumed after
        preemption (the output is replayed)."""
        kind, gid = req.sampling.guided_kind, req.sampling.guided_id
        output = req.history[req.num_prompt:]
        if kind == GuidedKind.TABLE:
            req.guided_state = self.table(gid).replay(output)
        elif kind == GuidedKind.GRAMMAR:
            req.matcher = self.grammars.matcher(gid, output)

    @staticmethod
    def pause(req: RequestState) -> None:
        """Preempted: forget the state (the resume replays it; its table may be dropped
        meanwhile)."""
        req.guided_state, req.matcher = -1, None

    def batch(self, reqs: list[RequestState]) -> GuidedBatch | None:
        """The plan's guided rows packed for the device; None when it has none."""
        kinds = [r.sampling.guided_kind for r in reqs]
        if all(k == GuidedKind.NONE for k in kinds):
            return None
        return GuidedBatch(self, reqs)


@dataclass
class _TableRows:
    table: DeviceTable
    rows: Tensor  # int64 [G]: the rows of the batch that use it


def _stop_columns(reqs: list[RequestState], rows: list[int]) -> np.ndarray:
    """[G, S] stop ids of the rows, padded with each row's first (a repeated column is
    harmless: they are only ever cleared); rows without stop ids point at token 0."""
    width = max(1, max(len(reqs[i].sampling.stop_token_ids) for i in rows))
    out = np.zeros((len(rows), width), dtype=np.int64)
    for j, i in enumerate(rows):
        ids = reqs[i].sampling.stop_token_ids
        if ids:
            out[j] = ids + [ids[0]] * (width - len(ids))
    return out


class GuidedBatch:
    """The guided rows of one plan's decode batch: their states, masks and advances."""

    def __init__(self, registry: GuidedRegistry, reqs: list[RequestState]) -> None:
        dev, size, vocab = registry.device, len(reqs), registry.vocab_size
        by_table: dict[str, list[int]] = {}
        grammar_rows: list[int] = []
        for i, r in enumerate(reqs):
            if r.sampling.guided_kind == GuidedKind.TABLE:
                by_table.setdefault(r.sampling.guided_id, []).append(i)
            elif r.sampling.guided_kind == GuidedKind.GRAMMAR:
                grammar_rows.append(i)
        self.tables = [_TableRows(registry.table(tid), _rows(rows, dev))
                       for tid, rows in by_table.items()]
        self.table_rows = [i for rows in by_table.values() for i in rows]
        self.state = torch.tensor([max(r.guided_state, 0) for r in reqs],
                                  dtype=torch.int32).to(dev, non_blocking=True)
        # True where a token is forbidden; unguided rows stay all False.
        self.blocked = torch.zeros(size, vocab, dtype=torch.bool, device=dev)
        self.grammar: GrammarRows | None = None
        if grammar_rows:
            self.grammar = registry.grammars.rows(
                grammar_rows, [reqs[i].matcher for i in grammar_rows])
        # min_new_tokens may only block stop ids where the constraint allows something else.
        strict = [i for i, r in enumerate(reqs)
                  if r.sampling.guided_kind != GuidedKind.NONE and r.sampling.min_new_tokens > 0]
        self.may_block: Tensor | None = None
        if strict:
            self.may_block = torch.ones(size, dtype=torch.bool, device=dev)
            self._strict_rows = _rows(strict, dev)
            self._strict_stops = torch.from_numpy(_stop_columns(reqs, strict)).to(dev)

    def masks(self) -> tuple[Tensor, Tensor | None]:
        """This step's forbidden tokens [B, V] and which rows min_new_tokens may hold back
        from their stop ids [B] (None: every row).  Grammar rows wait for the host here,
        after the step's forward was launched."""
        for t in self.tables:
            st = self.state.index_select(0, t.rows)
            bad = t.table.next_state.index_select(0, st) < 0  # [G, C]
            self.blocked.index_copy_(0, t.rows, bad.index_select(1, t.table.token_class))
        if self.grammar is not None:
            self.grammar.fill(self.blocked)
        if self.may_block is not None:
            allowed = self.blocked.index_select(0, self._strict_rows).logical_not_()
            allowed.scatter_(1, self._strict_stops, False)
            self.may_block.index_copy_(0, self._strict_rows, allowed.any(dim=1))
        return self.blocked, self.may_block

    def advance(self, tokens: Tensor, active: Tensor, last: bool) -> None:
        """Step every active guided row's state past its sampled token (-1: masked row)."""
        for t in self.tables:
            st = self.state.index_select(0, t.rows)
            tok = tokens.index_select(0, t.rows).clamp(min=0)
            cls = t.table.token_class.index_select(0, tok)
            nxt = t.table.flat.index_select(0, st * t.table.num_classes + cls)
            # A forbidden token is never sampled; were one, DONE ends the constraint.
            nxt = torch.where(nxt >= 0, nxt, t.table.num_states)
            keep = active.index_select(0, t.rows)
            self.state.index_copy_(0, t.rows, torch.where(keep, nxt, st))
        if self.grammar is not None:
            self.grammar.submit(tokens, last)

    def finish(self, reqs: list[RequestState], states: np.ndarray | None) -> None:
        """After the plan: the table states read back with its tokens, and the grammar
        matchers done with its last step."""
        if states is not None:
            for i in self.table_rows:
                reqs[i].guided_state = int(states[i])
        if self.grammar is not None:
            self.grammar.wait()


def _rows(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
