"""Guided constraints on the scheduler: one copy per id, and which ones the gpu worker holds.

Every `AddRequest` of a guided request carries its compiled constraint (`GuidedTable` or
`GuidedGrammar`), so the scheduler can always (re)send it; it keeps one copy per id while
any of its requests uses it.  The worker holds a constraint from the plan that first sends it
(in `StepPlan.tables`, never per request) until a plan drops it (`StepPlan.drop_tables`).
The scheduler decides, and the worker mirrors:

* a constraint is sent when a request using it starts running and the worker lacks it
  (fresh, or resumed after the worker dropped it);
* a constraint stays at the worker while a running request uses it; once none does it is
  "unused": the `keep_unused` most recently used of those stay (a request with the same
  constraint reuses it without a resend), older ones are dropped.

Preempted requests do not pin their constraint: the worker forgets a preempted request's
constraint state and replays it from the kept output when the request resumes.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from tandem_serve.proto.messages import AddRequest, GuidedGrammar, GuidedKind, GuidedTable

Constraint = GuidedTable | GuidedGrammar


def constraint_id(item: Constraint) -> str:
    return item.table_id if isinstance(item, GuidedTable) else item.grammar_id


@dataclass
class _Copy:
    item: Constraint
    refs: int = 0  # requests in the scheduler that carry it


def table_problem(t: GuidedTable, vocab_size: int) -> str | None:
    """What is wrong with a table's shape or contents (the worker indexes with it blindly)."""
    nxt, cls = np.asarray(t.next_state), np.asarray(t.token_class)
    if nxt.ndim != 2 or nxt.shape[0] < 2 or nxt.shape[1] < 1:
        return (f"guided.next_state has shape {nxt.shape}; it must be [S + 1, C] with at least "
                f"one state, the DONE row and one token class")
    if nxt.dtype.kind != "i" or cls.dtype.kind != "i":
        return "guided.next_state and guided.token_class must be integer arrays"
    done = nxt.shape[0] - 1
    if cls.shape != (vocab_size,) and vocab_size > 0:
        return (f"guided.token_class has shape {cls.shape}; the model's vocab_size is "
                f"{vocab_size}")
    if cls.size and (cls.min() < 0 or cls.max() >= nxt.shape[1]):
        return f"guided.token_class values must lie in [0, {nxt.shape[1]}) (the classes)"
    if nxt.min() < -1 or nxt.max() > done:
        return f"guided.next_state values must lie in [-1, {done}] (-1, a state or DONE)"
    if not 0 <= t.initial_state < done:
        return f"guided.initial_state={t.initial_state} must lie in [0, {done})"
    return None


class WorkerConstraints:
    """The copies the scheduler keeps and the set the worker holds (see the module doc)."""

    def __init__(self, keep_unused: int, vocab_size: int = 0) -> None:
        self.keep_unused = keep_unused
        self.vocab_size = vocab_size  # 0: unknown (tests), not checked
        self._copies: dict[str, _Copy] = {}
        # id -> running requests using it; unused ones (0) in the order they fell unused.
        self._held: OrderedDict[str, int] = OrderedDict()
        self._to_send: dict[str, Constraint] = {}

    @property
    def held(self) -> list[str]:
        return list(self._held)

    # ---------------------------------------------------------------- requests

    def problem(self, msg: AddRequest) -> str | None:
        """Why this request's constraint cannot run (None: it can, or it has none)."""
        kind, gid, item = msg.sampling.guided_kind, msg.sampling.guided_id, msg.guided
        if kind == GuidedKind.NONE:
            return None
        want = GuidedTable if kind == GuidedKind.TABLE else GuidedGrammar
        if not isinstance(item, want):
            return (f"sampling.guided_kind={kind.name} needs AddRequest.guided to be a "
                    f"{want.__name__}, got {type(item).__name__}")
        if constraint_id(item) != gid:
            return (f"AddRequest.guided has id {constraint_id(item)!r}, sampling.guided_id "
                    f"is {gid!r}")
        if gid in self._copies or gid in self._held:  # same id, same content: checked
            return None
        return table_problem(item, self.vocab_size) if isinstance(item, GuidedTable) else None

    def hold(self, msg: AddRequest) -> None:
        """A guided request entered the scheduler (after `problem` said None)."""
        if msg.sampling.guided_kind == GuidedKind.NONE or msg.guided is None:
            return
        copy = self._copies.setdefault(msg.sampling.guided_id, _Copy(msg.guided))
        copy.refs += 1

    def release(self, gid: str) -> None:
        """A request carrying `gid` left the scheduler."""
        copy = self._copies[gid]
        copy.refs -= 1
        if copy.refs == 0:
            del self._copies[gid]

    def start(self, gid: str) -> None:
        """A request using `gid` runs from the plan being built on (fresh or resumed)."""
        if gid not in self._held:
            self._to_send[gid] = self._copies[gid].item
            self._held[gid] = 0
        self._held[gid] += 1

    def stop(self, gid: str) -> None:
        """A running request using `gid` finished or was preempted."""
        self._held[gid] -= 1
        if self._held[gid] == 0:
            self._held.move_to_end(gid)  # the most recently used of the unused

    def take(self) -> tuple[list[Constraint], list[str]]:
        """What the plan being built sends, and the unused ids beyond `keep_unused` it drops
        (oldest first).  Call before this plan's requests finish by counts: they still run
        in it."""
        send, self._to_send = list(self._to_send.values()), {}
        unused = [gid for gid, users in self._held.items() if users == 0]
        drop = unused[: max(0, len(unused) - self.keep_unused)]
        for gid in drop:
            del self._held[gid]
        return send, drop

    # ---------------------------------------------------------------- checks

    def check_invariants(self, running: Counter[str], carried: Counter[str]) -> None:
        """`running`: ids used by running requests; `carried`: by every request."""
        users = {gid: n for gid, n in self._held.items() if n}
        assert users == dict(running), f"worker constraints in use {users} != {dict(running)}"
        refs = {gid: c.refs for gid, c in self._copies.items()}
        assert refs == dict(carried), f"constraint copies {refs} != requests {dict(carried)}"
        assert set(self._to_send) <= set(self._held)
