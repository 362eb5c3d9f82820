"""Guided decoding on the gpu worker: constraint tables on the device, and per plan the
masks and state advances of the guided rows of the decode batch.

A `GuidedTable` (regex, choice, JSON schema) is uploaded once, when a plan first sends it,
and stays until a plan drops its id.  A plan's decode batch puts its guided rows first,
grouped by table, so each group is a fixed slice of the batch; every one of the K steps then
runs a fixed sequence of device ops per group, with no host read and no data-dependent shape:

    bias[r, c]    = -inf if next_state[state[r], c] < 0 else 0     a [G, C] lookup
    logits[r, v] += bias[r, token_class[v]]                        before the sampler's draw
    state[r]      = next_state[state[r], token_class[tok[r]]]      after it

Adding a 0 / -inf bias gathered from the small [G, C] class mask is branch-free: on a CPU it
costs about half of a `masked_fill_` with a [G, V] boolean mask.  Most tables allow only a
few tokens in any state (a regex of digits, a choice): for those the tokens no state allows
get a fixed -inf row added (one broadcast add) and only the *live* tokens are gathered and
added (`index_add_` over L ≤ V/3 columns), a third of the cost at L in the hundreds.  Unguided
rows are not touched at all.  Between plans the state lives on the host: `_collect` reads the state
vector back with the plan's tokens, and a resumed (preempted) request replays its kept output
through the table on the host.  Grammar rows (`gpu_worker/constrain/grammar.py`) follow as one more
slice; their mask comes from llguidance on the host, one step behind.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tandem_serve.gpu_worker.constrain.grammar import GrammarRegistry, GrammarRows
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_params import GuidedKind

# The live-token path pays while at most this share of the vocabulary is live: at V/3 its
# broadcast add plus gather and index_add cost what the full gather does (measured on a CPU).
LIVE_SHARE = 3


@dataclass
class DeviceTable:
    """One table, on the device and (for replays after preemption) on the host."""

    next_state: Tensor  # int32 [S + 1, C]
    flat: Tensor  # the same, flat: next state of (state, class) at state * C + class
    token_class: Tensor  # int64 [V]
    host: GuidedTable
    # Few live tokens (some state allows them): their ids [L] and classes [L], and a [V] row
    # of -inf on every other token.  None: gather over the whole vocabulary.
    live: Tensor | None = None
    live_class: Tensor | None = None
    dead_bias: Tensor | None = None

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

    def class_sizes(self) -> np.ndarray:
        """Tokens per class [C] (host)."""
        return np.bincount(self.host.token_class, minlength=self.num_classes)


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
        cls = torch.tensor(np.asarray(t.token_class, dtype=np.int64), device=self.device)
        table = DeviceTable(nxt, nxt.view(-1), cls, t)
        allowed_somewhere = np.asarray((np.asarray(t.next_state) >= 0).any(axis=0))  # [C]
        live = np.flatnonzero(allowed_somewhere[t.token_class])
        if len(live) <= self.vocab_size // LIVE_SHARE:
            dead = np.full(self.vocab_size, -np.inf, dtype=np.float32)
            dead[live] = 0.0
            table.live = torch.tensor(live, dtype=torch.int64, device=self.device)
            table.live_class = cls.index_select(0, table.live)
            table.dead_bias = torch.tensor(dead, device=self.device)
        return table

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
        """The plan's guided rows packed for the device; None when it has none.  `reqs` must
        be in `batch_order`."""
        if not reqs or reqs[0].sampling.guided_kind == GuidedKind.NONE:
            return None
        return GuidedBatch(self, reqs)


def batch_order(reqs: list[RequestState]) -> list[RequestState]:
    """Guided rows first, grouped by table, then grammar rows, then the rest: each group is a
    slice of the decode batch (row order means nothing else: tokens travel with their ids)."""
    def key(r: RequestState) -> tuple[int, str]:
        kind = r.sampling.guided_kind
        rank = {GuidedKind.TABLE: 0, GuidedKind.GRAMMAR: 1}.get(kind, 2)
        return rank, r.sampling.guided_id if kind == GuidedKind.TABLE else ""
    return sorted(reqs, key=key)


def _nonstop_classes(table: DeviceTable, reqs: list[RequestState]) -> np.ndarray:
    """[G, C] bool: the class holds some token that is not one of the row's stop ids."""
    sizes = table.class_sizes()
    vocab = len(table.host.token_class)
    out = np.ones((len(reqs), table.num_classes), dtype=bool)
    for j, r in enumerate(reqs):
        stops = np.unique([t for t in r.sampling.stop_token_ids if 0 <= t < vocab])
        stop_counts = np.bincount(table.host.token_class[stops.astype(np.int64)],
                                  minlength=table.num_classes)
        out[j] = sizes > stop_counts
    return out


@dataclass
class _Group:
    """The rows [lo, hi) of the batch that use one table."""

    table: DeviceTable
    lo: int
    hi: int
    nonstop: Tensor | None  # [G, C] bool, when some row of the group has min_new_tokens
    vocab_bias: Tensor  # [G, V] or [G, L] f32, rewritten every step (one buffer per plan)
    bias: Tensor | None = None  # this step's [G, C] class bias: -inf = forbidden, else 0


class GuidedBatch:
    """The guided rows of one plan's decode batch: their states, masks and advances."""

    def __init__(self, registry: GuidedRegistry, reqs: list[RequestState]) -> None:
        dev = registry.device
        self.groups: list[_Group] = []
        lo = 0
        while lo < len(reqs) and reqs[lo].sampling.guided_kind == GuidedKind.TABLE:
            tid = reqs[lo].sampling.guided_id
            hi = lo
            while (hi < len(reqs) and reqs[hi].sampling.guided_kind == GuidedKind.TABLE
                   and reqs[hi].sampling.guided_id == tid):
                hi += 1
            table, rows = registry.table(tid), reqs[lo:hi]
            nonstop = None
            if any(r.sampling.min_new_tokens > 0 for r in rows):
                nonstop = torch.from_numpy(_nonstop_classes(table, rows)).to(dev)
            width = registry.vocab_size if table.live is None else len(table.live)
            buf = torch.empty(hi - lo, width, device=dev)
            self.groups.append(_Group(table, lo, hi, nonstop, buf))
            lo = hi
        self.num_table_rows = lo
        self.state = torch.tensor([max(r.guided_state, 0) for r in reqs[:lo]],
                                  dtype=torch.int32).to(dev, non_blocking=True)
        hi = lo
        while hi < len(reqs) and reqs[hi].sampling.guided_kind == GuidedKind.GRAMMAR:
            hi += 1
        self.grammar: GrammarRows | None = None
        if hi > lo:
            self.grammar = registry.grammars.rows(lo, reqs[lo:hi])
        # min_new_tokens may only hold back stop ids where the constraint allows more.
        strict = any(r.sampling.guided_kind != GuidedKind.NONE and r.sampling.min_new_tokens
                     for r in reqs)
        self.may_block = torch.ones(len(reqs), dtype=torch.bool, device=dev) if strict else None

    def prepare(self) -> Tensor | None:
        """This step's masks, and which rows min_new_tokens may hold back from their stop ids
        ([B] bool; None: every row).  Grammar rows wait for the host here, after the step's
        forward was launched."""
        for g in self.groups:
            bad = g.table.next_state.index_select(0, self.state[g.lo: g.hi]) < 0
            g.bias = torch.where(bad, float("-inf"), 0.0)
            if g.nonstop is not None and self.may_block is not None:
                self.may_block[g.lo: g.hi] = (g.nonstop & ~bad).any(dim=1)
        if self.grammar is not None:
            self.grammar.prepare(self.may_block)
        return self.may_block

    def apply_(self, logits: Tensor) -> None:
        """Step 4 of the sampler: -inf on every token the guided rows' states forbid."""
        for g in self.groups:
            assert g.bias is not None, "prepare() comes first"
            t, rows = g.table, logits[g.lo: g.hi]
            if t.live is None:
                index = t.token_class.expand(g.hi - g.lo, -1)
                rows.add_(torch.gather(g.bias, 1, index, out=g.vocab_bias))
            else:
                assert t.live_class is not None and t.dead_bias is not None
                rows.add_(t.dead_bias)
                index = t.live_class.expand(g.hi - g.lo, -1)
                rows.index_add_(1, t.live, torch.gather(g.bias, 1, index, out=g.vocab_bias))
        if self.grammar is not None:
            self.grammar.apply_(logits)

    def advance(self, tokens: Tensor, active: Tensor, last: bool) -> None:
        """Step every active guided row's state past its sampled token (-1: masked row)."""
        for g in self.groups:
            t = g.table
            st = self.state[g.lo: g.hi]
            cls = t.token_class.index_select(0, tokens[g.lo: g.hi].clamp(min=0))
            nxt = t.flat.index_select(0, st.to(torch.int64) * t.num_classes + cls)
            # A forbidden token is never sampled; were one, DONE ends the constraint.
            nxt = torch.where(nxt >= 0, nxt, t.num_states)
            st.copy_(torch.where(active[g.lo: g.hi], nxt, st))
        if self.grammar is not None:
            self.grammar.submit(tokens, last)

    def finish(self, reqs: list[RequestState], states: np.ndarray | None) -> None:
        """After the plan: the table states read back with its tokens, and the grammar
        matchers done with its last step."""
        if states is not None:
            for i in range(self.num_table_rows):
                reqs[i].guided_state = int(states[i])
        if self.grammar is not None:
            self.grammar.wait()
