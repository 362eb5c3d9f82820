"""The scheduler's guided constraints, one scripted case at a time: each is sent to the worker
once (not per request), dropped when no request uses it beyond the kept ones, resent when a
request resumes after it was dropped, and a malformed one fails its request alone.
"""
from __future__ import annotations

import numpy as np
import pytest

from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.plan_messages import StepPlan
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, GuidedKind, SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed
from tandem_serve.scheduler.core import Scheduler
from tests.scheduler.sched_utils import add, params, step_done

VOCAB = 8


def _table(tid: str, **kw: object) -> GuidedTable:
    fields: dict[str, object] = dict(
        next_state=np.array([[1, -1], [-1, 2], [-1, 2]], dtype=np.int32),
        token_class=np.array([0] * (VOCAB - 1) + [1], dtype=np.int32))
    fields.update(kw)
    return GuidedTable(tid, **fields)  # type: ignore[arg-type]


def _add(sched: Scheduler, rid: int, item: GuidedTable | GuidedGrammar, prompt: int = 3,
         max_new: int = 8) -> None:
    kind = GuidedKind.TABLE if isinstance(item, GuidedTable) else GuidedKind.GRAMMAR
    gid = item.table_id if isinstance(item, GuidedTable) else item.grammar_id
    sampling = SamplingParams(max_new_tokens=max_new, guided_kind=kind, guided_id=gid)
    msg = AddRequest(rid, np.arange(1, prompt + 1, dtype=np.int32), sampling, 0.0, item)
    assert sched.add_request(msg) is None


def _ids(plan: StepPlan) -> list[str]:
    return [t.table_id if isinstance(t, GuidedTable) else t.grammar_id for t in plan.tables]


def _finish(sched: Scheduler, plan: StepPlan, *rids: int) -> None:
    sched.on_step_done(step_done(plan.plan_id, {r: FinishReason.EOS_TOKEN for r in rids}))
    sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
    sched.check_invariants()


def test_a_constraint_is_sent_once_and_reused_while_kept() -> None:
    sched = Scheduler(params(vocab_size=VOCAB, guided_kept=1))
    a, b = _table("a"), GuidedGrammar("g", 'start: "x"')
    _add(sched, 1, a)
    _add(sched, 2, a)  # the same table: one copy, one send
    _add(sched, 3, b)
    plan = sched.build_plan()
    assert _ids(plan) == ["a", "g"] and plan.drop_tables == []
    assert plan.tables[0] is a
    _finish(sched, plan, 1, 2)  # "a" unused now, and kept (guided_kept=1)
    plan = sched.build_plan()
    assert plan.tables == [] and plan.drop_tables == [] and sorted(plan.drop) == [1, 2]
    _add(sched, 4, _table("a"))  # a later request with the same table: nothing to send
    plan2 = sched.build_plan()
    assert plan2.tables == [] and [n.request_id for n in plan2.new] == [4]
    _finish(sched, plan, 3)
    _finish(sched, plan2, 4)  # "g" fell unused first, then "a": the oldest goes
    plan = sched.build_plan()
    assert plan.drop_tables == ["g"] and plan.tables == []
    _add(sched, 5, b)  # dropped: sent again
    assert _ids(sched.build_plan()) == ["g"]
    sched.check_invariants()


def test_a_resumed_request_gets_its_dropped_constraint_again() -> None:
    sched = Scheduler(params(num_blocks=4, num_steps=4, vocab_size=VOCAB, guided_kept=0))
    add(sched, 1, 4, max_new=20)  # 7 positions: 2 blocks of 4
    _add(sched, 2, _table("a"), prompt=3, max_new=20)  # 6 positions: the other 2
    plan = sched.build_plan()
    assert _ids(plan) == ["a"] and len(plan.new) == 2
    _finish(sched, plan)
    plan = sched.build_plan()  # request 1 grows to 11 positions: the newest gives way
    assert plan.preempt == [2]
    assert plan.drop_tables == ["a"], "nobody runs with it: the worker forgets it"
    _finish(sched, plan)
    sched.abort_request(1)  # its blocks free up: request 2 resumes
    plan = sched.build_plan()
    assert [n.request_id for n in plan.new if n.resume] == [2] and _ids(plan) == ["a"]
    assert plan.drop == [1]
    sched.check_invariants()


@pytest.mark.parametrize(("item", "kind", "gid", "needle"), [
    (GuidedGrammar("g", "start: x"), GuidedKind.TABLE, "g", "GuidedTable, got GuidedGrammar"),
    (_table("a"), GuidedKind.TABLE, "b", "sampling.guided_id is 'b'"),
    (_table("a", token_class=np.zeros(VOCAB + 1, np.int32)), GuidedKind.TABLE, "a",
     f"vocab_size is {VOCAB}"),
    (_table("a", token_class=np.full(VOCAB, 2, np.int32)), GuidedKind.TABLE, "a",
     "token_class values must lie in [0, 2)"),
    (_table("a", next_state=np.array([[3, -1], [-1, 0]], np.int32)), GuidedKind.TABLE, "a",
     "next_state values must lie in [-1, 1]"),
    (_table("a", next_state=np.zeros(4, np.int32)), GuidedKind.TABLE, "a", "[S + 1, C]"),
    (_table("a", initial_state=2), GuidedKind.TABLE, "a", "initial_state=2"),
])
def test_a_malformed_constraint_fails_its_request_alone(
        item: GuidedTable | GuidedGrammar | None, kind: GuidedKind, gid: str,
        needle: str) -> None:
    sched = Scheduler(params(vocab_size=VOCAB))
    add(sched, 1, 5)
    sampling = SamplingParams(guided_kind=kind, guided_id=gid)
    assert sched.add_request(AddRequest(2, np.ones(3, np.int32), sampling, 0.0, item)) is None
    [failure] = sched.take_failures()
    assert failure.request_id == 2 and failure.reason == FinishReason.ERROR
    assert needle in failure.message, failure.message
    plan = sched.build_plan()
    assert [n.request_id for n in plan.new] == [1] and plan.tables == []
    sched.check_invariants()
