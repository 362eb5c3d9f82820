"""Guided constraints on the scheduler: which tables it has, and which the gpu worker holds.

A guided request names its constraint by content id (`SamplingParams.guided_id`); the table
(`GuidedTable` or `GuidedGrammar`) comes from the frontend as a message of its own, once per
id, just before the first request that names it, and again whenever the scheduler asks
(`GuidedWanted`).  A request may also carry it in `AddRequest.guided`.  The scheduler keeps
one copy per id while a request in it names the id and the copy has arrived; the worker holds
a constraint from the plan that first sends it (in `StepPlan.tables`, never per request)
until a plan drops it (`StepPlan.drop_tables`).  The scheduler decides, and the worker
mirrors:

* a constraint is sent when a request using it starts running and the worker lacks it
  (fresh, or resumed after the worker dropped it);
* a constraint stays at the worker while a running request uses it; once none does it is
  "unused": the `keep_unused` most recently used of those stay (a request with the same
  constraint reuses it without a resend), older ones are dropped.

A request can start only while its constraint is at the worker or its copy is here
(`ready`); otherwise the scheduler asks the frontend for it (once per id until answered):
when a request names an id it has never seen (the frontend sent it to a scheduler since
replaced, or the scheduler let its copy go once no request named it and the worker has
dropped it since), and when the worker drops an id that a waiting request still names but
whose copy never came here.  The frontend answers with the table or with `GuidedLost`, which
fails the requests that name it; a table that arrives malformed fails them too.

Preempted requests do not pin their constraint: the worker forgets a preempted request's
constraint state and replays it from the kept output when the request resumes.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import GuidedKind, SamplingParams

Constraint = GuidedTable | GuidedGrammar

# Tables that arrived before any request named them (the frontend sends a table just before
# its first request, which may come in a later read of the inbox); a few, newest kept.
LOOSE_KEPT = 4
BAD_KEPT = 1024  # ids whose table arrived malformed: their later requests fail at once


def constraint_id(item: Constraint) -> str:
    return item.table_id if isinstance(item, GuidedTable) else item.grammar_id


def kind_of(item: Constraint) -> GuidedKind:
    return GuidedKind.TABLE if isinstance(item, GuidedTable) else GuidedKind.GRAMMAR


@dataclass
class _Copy:
    kind: GuidedKind  # as the requests name it
    refs: int = 0  # requests in the scheduler that name it
    item: Constraint | None = None  # None: not here (at the worker, or on its way)


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


def _carried_problem(msg: AddRequest) -> str | None:
    """Whether a constraint carried in the request is the one its sampling params name."""
    kind, gid, item = msg.sampling.guided_kind, msg.sampling.guided_id, msg.guided
    want = GuidedTable if kind == GuidedKind.TABLE else GuidedGrammar
    if not isinstance(item, want):
        return (f"sampling.guided_kind={kind.name} needs AddRequest.guided to be a "
                f"{want.__name__}, got {type(item).__name__}")
    if constraint_id(item) != gid:
        return (f"AddRequest.guided has id {constraint_id(item)!r}, sampling.guided_id "
                f"is {gid!r}")
    return None


def _kind_problem(kind: GuidedKind, gid: str, known: GuidedKind) -> str | None:
    if kind == known:
        return None
    return f"sampling.guided_kind={kind.name}, but constraint {gid!r} is a {known.name}"


class WorkerConstraints:
    """The copies the scheduler keeps and the set the worker holds (see the module doc)."""

    def __init__(self, keep_unused: int, vocab_size: int = 0) -> None:
        self.keep_unused = keep_unused
        self.vocab_size = vocab_size  # 0: unknown (tests), not checked
        self._copies: dict[str, _Copy] = {}  # ids that requests in the scheduler name
        self._loose: OrderedDict[str, Constraint] = OrderedDict()
        self._bad: OrderedDict[str, str] = OrderedDict()  # id -> what is wrong with it
        # id -> running requests using it; unused ones (0) in the order they fell unused.
        self._held: OrderedDict[str, int] = OrderedDict()
        self._held_kind: dict[str, GuidedKind] = {}
        self._to_send: dict[str, Constraint] = {}
        self._asked: set[str] = set()  # asked the frontend for, no answer yet
        self._to_ask: list[str] = []

    @property
    def held(self) -> list[str]:
        return list(self._held)

    # ---------------------------------------------------------------- tables in

    def receive(self, item: Constraint) -> str | None:
        """A table sent on its own; what is wrong with it (its requests fail) or None."""
        gid = constraint_id(item)
        self._asked.discard(gid)
        copy = self._copies.get(gid)
        if (copy is not None and copy.item is not None) or gid in self._loose:
            return None  # same id, same content: this one was checked
        problem = self._table_problem(item)
        if problem is not None:
            self._bad[gid] = problem
            while len(self._bad) > BAD_KEPT:
                self._bad.popitem(last=False)
            return problem
        if copy is not None:
            mismatch = _kind_problem(copy.kind, gid, kind_of(item))
            if mismatch is not None:  # the requests are wrong, not the table
                return mismatch
            copy.item = item
        elif gid not in self._held:
            self._loose[gid] = item
            while len(self._loose) > LOOSE_KEPT:
                self._loose.popitem(last=False)
        return None

    def lost(self, gid: str) -> bool:
        """The frontend cannot send `gid`: whether its requests must fail (False when it came
        back in the meantime, or no request names it any more)."""
        self._asked.discard(gid)
        return gid in self._copies and not self.ready_id(gid)

    def take_wanted(self) -> list[str]:
        """Ids to ask the frontend for (each once until it answers)."""
        wanted, self._to_ask = self._to_ask, []
        return [gid for gid in wanted if gid in self._asked]  # not answered meanwhile

    def _want(self, gid: str) -> None:
        if gid not in self._asked:
            self._asked.add(gid)
            self._to_ask.append(gid)

    def _table_problem(self, item: Constraint) -> str | None:
        return table_problem(item, self.vocab_size) if isinstance(item, GuidedTable) else None

    # ---------------------------------------------------------------- requests

    def problem(self, msg: AddRequest) -> str | None:
        """Why this request's constraint cannot run (None: it can, it may once its table
        arrives, or it has none)."""
        kind, gid, item = msg.sampling.guided_kind, msg.sampling.guided_id, msg.guided
        if kind == GuidedKind.NONE:
            return None
        if item is not None:
            carried = _carried_problem(msg)
            if carried is not None:
                return carried
        bad = self._bad.get(gid)
        if bad is not None:
            return bad
        known = self._known_kind(gid)
        if known is not None:  # same id, same content: checked when it came
            return _kind_problem(kind, gid, known)
        return self._table_problem(item) if item is not None else None

    def _known_kind(self, gid: str) -> GuidedKind | None:
        copy = self._copies.get(gid)
        if copy is not None:
            return copy.kind
        loose = self._loose.get(gid)
        return kind_of(loose) if loose is not None else self._held_kind.get(gid)

    def hold(self, msg: AddRequest) -> None:
        """A guided request entered the scheduler (after `problem` said None)."""
        kind, gid = msg.sampling.guided_kind, msg.sampling.guided_id
        if kind == GuidedKind.NONE:
            return
        copy = self._copies.get(gid)
        if copy is None:
            copy = self._copies[gid] = _Copy(kind, item=self._loose.pop(gid, None))
        if copy.item is None and msg.guided is not None:
            copy.item = msg.guided
        copy.refs += 1
        if not self.ready_id(gid):
            self._want(gid)

    def release(self, gid: str) -> None:
        """A request naming `gid` left the scheduler."""
        copy = self._copies[gid]
        copy.refs -= 1
        if copy.refs == 0:
            del self._copies[gid]

    def ready(self, sampling: SamplingParams) -> bool:
        """Whether a request with these params may start now (its constraint is at the
        worker or here)."""
        return sampling.guided_kind == GuidedKind.NONE or self.ready_id(sampling.guided_id)

    def ready_id(self, gid: str) -> bool:
        copy = self._copies.get(gid)
        return gid in self._held or (copy is not None and copy.item is not None)

    def start(self, gid: str) -> None:
        """A request using `gid` runs from the plan being built on (fresh or resumed); only
        once `ready`."""
        if gid not in self._held:
            item = self._copies[gid].item
            assert item is not None, f"constraint {gid} started before its table arrived"
            self._to_send[gid] = item
            self._held[gid] = 0
            self._held_kind[gid] = kind_of(item)
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
            del self._held_kind[gid]
            if gid in self._copies and not self.ready_id(gid):
                self._want(gid)  # a waiting request names it: have it here by its start
        return send, drop

    # ---------------------------------------------------------------- checks

    def check_invariants(self, running: Counter[str], carried: Counter[str]) -> None:
        """`running`: ids used by running requests; `carried`: by every request."""
        users = {gid: n for gid, n in self._held.items() if n}
        assert users == dict(running), f"worker constraints in use {users} != {dict(running)}"
        refs = {gid: c.refs for gid, c in self._copies.items()}
        assert refs == dict(carried), f"constraint copies {refs} != requests {dict(carried)}"
        assert set(self._to_send) <= set(self._held)
        assert set(self._held_kind) == set(self._held)
        assert not set(self._loose) & set(self._copies), "a loose table that a request names"
        waiting = {gid for gid in self._copies if not self.ready_id(gid)}
        assert waiting <= self._asked, f"tables {waiting - self._asked} wanted, never asked"
