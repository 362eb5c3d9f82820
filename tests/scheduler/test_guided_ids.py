"""Guided requests that name their constraint by id only, its table sent on its own: the
scheduler forwards each table to the worker once, asks the frontend (`GuidedWanted`) for one
it lacks — never seen, or dropped at the worker while a request still waited for it — holds
such a request back until the table comes, and fails only the requests of a table that is
lost or malformed.
"""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedLost
from tandem_serve.proto.plan_messages import StepPlan
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, GuidedKind, SamplingParams
from tandem_serve.scheduler.core import Scheduler
from tests.scheduler.sched_utils import add, params
from tests.scheduler.test_guided import VOCAB, _finish, _ids, _table


def _named(sched: Scheduler, rid: int, gid: str, kind: GuidedKind = GuidedKind.TABLE,
           prompt: int = 3, max_new: int = 8) -> None:
    """A request that carries its constraint's id, not its table (as the frontend sends)."""
    sampling = SamplingParams(max_new_tokens=max_new, guided_kind=kind, guided_id=gid)
    msg = AddRequest(rid, np.arange(1, prompt + 1, dtype=np.int32), sampling, 0.0)
    assert msg.guided is None
    assert sched.add_request(msg) is None


def _new(plan: StepPlan) -> list[int]:
    return [n.request_id for n in plan.new]


def test_a_table_sent_on_its_own_goes_to_the_worker_once() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    a, g = _table("a"), GuidedGrammar("g", 'start: "x"')
    sched.on_constraint(a)
    sched.on_constraint(g)
    for rid in (1, 2):
        _named(sched, rid, "a")
    _named(sched, 3, "g", GuidedKind.GRAMMAR)
    plan = sched.build_plan()
    assert _new(plan) == [1, 2, 3] and _ids(plan) == ["a", "g"] and plan.tables[0] is a
    assert sched.take_wanted_constraints() == []
    sched.check_invariants()


def test_an_unknown_id_is_asked_for_and_its_request_waits_for_it() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    add(sched, 1, 5)
    _named(sched, 2, "a")
    _named(sched, 3, "a")
    assert sched.take_wanted_constraints() == ["a"]  # once, not per request
    plan = sched.build_plan()
    assert _new(plan) == [1] and plan.tables == []
    _finish(sched, plan)
    assert not sched.ready_to_plan() or _new(sched.build_plan()) == []
    sched.on_constraint(_table("a"))
    assert sched.take_wanted_constraints() == []
    plan = sched.build_plan()
    assert _new(plan) == [2, 3] and _ids(plan) == ["a"]
    sched.check_invariants()


def test_alone_it_waits_for_a_message_not_a_plan() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    _named(sched, 1, "a")
    assert not sched.ready_to_plan(), "no empty plans while its table is on its way"
    sched.on_constraint(_table("a"))
    assert sched.ready_to_plan() and _new(sched.build_plan()) == [1]


def test_after_the_worker_dropped_it_a_new_request_gets_it_resent() -> None:
    sched = Scheduler(params(vocab_size=VOCAB, guided_kept=0))
    sched.on_constraint(_table("a"))
    _named(sched, 1, "a")
    plan = sched.build_plan()
    assert _ids(plan) == ["a"]
    _finish(sched, plan, 1)
    plan = sched.build_plan()
    assert plan.drop_tables == ["a"] and plan.drop == [1]
    _finish(sched, plan)
    _named(sched, 2, "a")  # the frontend sent it once already: only the id comes
    assert sched.take_wanted_constraints() == ["a"]
    assert not sched.ready_to_plan()
    sched.on_constraint(_table("a"))  # the frontend's answer
    plan = sched.build_plan()
    assert _new(plan) == [2] and _ids(plan) == ["a"]
    sched.check_invariants()


def test_a_waiting_request_whose_table_the_worker_drops_has_it_asked_for_at_once() -> None:
    """Its id was at the worker when it came (so no table came with it), and the worker
    drops the table before the request can start: the drop asks for it again."""
    sched = Scheduler(params(num_blocks=4, num_steps=4, vocab_size=VOCAB, guided_kept=0))
    add(sched, 1, 4, max_new=20)  # 7 positions: 2 blocks of 4, then 3
    sched.on_constraint(_table("a"))
    _named(sched, 0, "a", max_new=1)  # 3 positions: 1 block
    plan = sched.build_plan()
    assert _new(plan) == [1, 0] and _ids(plan) == ["a"]
    _finish(sched, plan, 0)  # nobody names "a" here now; the worker still holds it
    _named(sched, 2, "a", max_new=20)  # 6 positions: 2 blocks, only 1 is free
    assert sched.take_wanted_constraints() == [], "at the worker: nothing to ask for"
    plan = sched.build_plan()
    assert _new(plan) == [] and plan.drop_tables == ["a"] and plan.drop == [0]
    assert sched.take_wanted_constraints() == ["a"]
    _finish(sched, plan)
    sched.abort_request(1)  # room for request 2, whose table has not come back yet
    plan = sched.build_plan()
    assert _new(plan) == [] and plan.drop == [1]
    _finish(sched, plan)
    sched.on_constraint(_table("a"))
    plan = sched.build_plan()
    assert _new(plan) == [2] and _ids(plan) == ["a"]
    sched.check_invariants()


def test_a_lost_table_fails_only_its_requests() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    add(sched, 1, 5)
    _named(sched, 2, "x")
    sched.on_constraint(_table("y"))
    _named(sched, 3, "y")
    assert sched.take_wanted_constraints() == ["x"]
    sched.on_constraint_lost(GuidedLost("x", "guided constraint x is no longer held"))
    [failure] = sched.take_failures()
    assert failure.request_id == 2 and failure.reason == FinishReason.ERROR
    assert failure.code == "UNAVAILABLE" and "no longer held" in failure.message
    plan = sched.build_plan()
    assert _new(plan) == [1, 3] and _ids(plan) == ["y"]
    sched.check_invariants()


def test_a_loss_after_the_table_came_back_fails_nobody() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    _named(sched, 1, "x")
    sched.on_constraint(_table("x"))  # sent with a newer request before the answer
    sched.on_constraint_lost(GuidedLost("x", "gone"))
    assert sched.take_failures() == [] and _new(sched.build_plan()) == [1]


def test_a_malformed_table_on_its_own_fails_the_requests_that_name_it() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    add(sched, 1, 5)
    _named(sched, 2, "a")
    _named(sched, 3, "a")
    assert sched.take_wanted_constraints() == ["a"]
    sched.on_constraint(_table("a", initial_state=2))
    failures = sched.take_failures()
    assert sorted(f.request_id for f in failures) == [2, 3]
    assert all("initial_state=2" in f.message and f.reason == FinishReason.ERROR
               for f in failures)
    _named(sched, 4, "a")  # known bad: fails at once, without asking again
    [failure] = sched.take_failures()
    assert failure.request_id == 4 and sched.take_wanted_constraints() == []
    plan = sched.build_plan()
    assert _new(plan) == [1] and plan.tables == []
    sched.check_invariants()


def test_a_kind_that_does_not_match_the_table_fails_the_request() -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    sched.on_constraint(GuidedGrammar("g", 'start: "x"'))
    _named(sched, 1, "g", GuidedKind.TABLE)
    [failure] = sched.take_failures()
    assert failure.request_id == 1 and "is a GRAMMAR" in failure.message
    _named(sched, 2, "t", GuidedKind.GRAMMAR)
    sched.on_constraint(_table("t"))
    [failure] = sched.take_failures()
    assert failure.request_id == 2 and "is a TABLE" in failure.message
    sched.check_invariants()
