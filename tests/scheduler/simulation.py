"""The scheduler simulation: a Scheduler, a fake gpu worker and fake postproc workers
exchanging messages in random orders, with the scheduler's invariants checked after each.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

import numpy as np

from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedLost, GuidedTable
from tandem_serve.proto.plan_messages import PlanEnding, StepDone, StepPlan
from tandem_serve.proto.request_messages import AddRequest
from tandem_serve.proto.request_params import FinishReason, GuidedKind, SamplingParams
from tandem_serve.proto.token_messages import PlanProcessed, StopHit
from tandem_serve.scheduler.core import Scheduler, SchedulerParams
from tests.scheduler.fake_workers import VOCAB, FakePostproc, FakeWorker, PostprocState, Row

# Guided constraints the simulated requests share (ids as the compiler would name them).
TABLES = [GuidedTable(f"table-{i}", np.array([[1, -1], [-1, 2], [-1, 2]], dtype=np.int32),
                      np.array([0] * (VOCAB - 1) + [1], dtype=np.int32)) for i in range(5)]
GRAMMARS = [GuidedGrammar(f"grammar-{i}", 'start: "x"+') for i in range(2)]


def guided_request(rng: random.Random, sampling: SamplingParams) -> GuidedTable | GuidedGrammar:
    """Make `sampling` guided by one of a few shared constraints; return the constraint."""
    item: GuidedTable | GuidedGrammar = rng.choice([*TABLES, *GRAMMARS])
    if isinstance(item, GuidedTable):
        sampling.guided_kind, sampling.guided_id = GuidedKind.TABLE, item.table_id
    else:
        sampling.guided_kind, sampling.guided_id = GuidedKind.GRAMMAR, item.grammar_id
    return item


@dataclass
class Simulation:
    params: SchedulerParams
    seed: int
    num_requests: int = 200
    p_eos: float = 0.02
    p_stop: float = 0.05
    p_abort: float = 0.01
    shared_prefixes: bool = True
    max_plans: int = 20_000
    p_guided: float = 0.4
    adapters: int = 0  # distinct LoRA adapters the requests spread over (most use one)
    # Requests name their constraint by id; a fake frontend sends each table on its own
    # once, forgets now and then what it sent, and answers the scheduler's GuidedWanted
    # late (the table, or GuidedLost once no live request names it).
    ids_only: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.sched = Scheduler(self.params)
        self.worker = FakeWorker(self.params, random.Random(self.seed + 1), self.p_eos)
        self.guided_rng = random.Random(self.seed + 99)  # apart: the workload stays the same
        self.guided_of: dict[int, str] = {}  # request id -> its constraint's id
        self.constraint_of: dict[int, GuidedTable | GuidedGrammar] = {}
        self.sent: set[str] = set()  # the fake frontend's ids sent
        self.wanted: deque[str] = deque()  # asked for, not answered yet
        self.num_asked = 0
        self.paused: set[int] = set()  # preempted at the worker, not resumed yet
        n = self.params.num_postproc_workers
        self.postprocs = [FakePostproc(i, random.Random(self.seed + 2 + i), self.p_stop)
                          for i in range(n)]
        self.worker_inbox: deque[StepPlan] = deque()
        self.from_worker: deque[StepDone] = deque()
        self.postproc_inbox: list[deque[tuple[int, list[list[Row]]]]] = [deque() for _ in range(n)]
        self.from_postproc: list[deque[StopHit | PlanProcessed]] = [deque() for _ in range(n)]
        self.arrivals = deque(self._make_requests())
        self.ended: dict[int, str] = {}  # the frontend's view
        self.known: set[int] = set()  # sent to the worker by a built plan, not dropped yet
        self.informed: set[int] = set()  # the scheduler was told this request finished
        self.must_drop: set[int] = set()
        self.plans_built = 0
        self.step_done_seen: set[int] = set()
        self.processed_seen: dict[int, set[int]] = defaultdict(set)
        self.seen_produced: Counter[int] = Counter()
        self.limits: dict[int, int] = {}
        self.arrived_at_plan: dict[int, int] = {}
        self.ended_at_plan: dict[int, int] = {}

    # ---------------------------------------------------------------- requests

    def _make_requests(self) -> list[tuple[AddRequest, bool]]:
        rng = self.rng
        prefixes = [[rng.randrange(VOCAB) for _ in range(n)] for n in (8, 12, 13)]
        out = []
        for rid in range(self.num_requests):
            if rng.random() < 0.03:
                prompt = [rng.randrange(VOCAB)
                          for _ in range(self.params.max_model_len + rng.randrange(4))]
            elif self.shared_prefixes and rng.random() < 0.5:
                prompt = rng.choice(prefixes) + [rng.randrange(VOCAB)
                                                 for _ in range(rng.randrange(16))]
            else:
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            sampling = SamplingParams(max_new_tokens=rng.randint(1, 30))
            if self.params.scheduling_policy == "priority":  # no draw: the workload stays
                sampling.priority = (rid * 7919) % 4
            msg = AddRequest(1000 + rid, np.array(prompt, dtype=np.int32), sampling, float(rid))
            if self.guided_rng.random() < self.p_guided:
                item = guided_request(self.guided_rng, sampling)
                self.guided_of[msg.request_id] = sampling.guided_id
                self.constraint_of[msg.request_id] = item
                if not self.ids_only:
                    msg.guided = item
            if self.adapters and rng.random() < 0.8:
                msg.adapter_id = f"lora-{rng.randrange(self.adapters)}"
                self.worker.adapter_of[msg.request_id] = msg.adapter_id
            out.append((msg, rng.random() < 0.3))
        return out

    # ---------------------------------------------------------------- scheduler side

    def after_event(self) -> None:
        self.sched.check_invariants()
        self.take_failures()
        while self.sched.ready_to_plan():
            plan = self.sched.build_plan()
            self.sched.check_invariants()
            self.on_plan_built(plan)
            self.take_failures()
        wanted = self.sched.take_wanted_constraints()
        assert not set(wanted) & set(self.wanted), "asked twice before an answer"
        self.wanted.extend(wanted)
        self.num_asked += len(wanted)

    def answer_wanted(self) -> None:
        gid = self.wanted.popleft()
        users = [rid for rid in self.live_requests() if self.guided_of.get(rid) == gid]
        if users:
            self.sched.on_constraint(self.constraint_of[users[0]])
            self.sent.add(gid)
        else:
            self.sched.on_constraint_lost(GuidedLost(gid, "no open request uses it"))
        self.after_event()

    def take_failures(self) -> None:
        for failure in self.sched.take_failures():
            rid = failure.request_id
            assert failure.message
            if failure.reason == FinishReason.ERROR:  # its table lost: the frontend was done
                assert failure.code == "UNAVAILABLE" and rid in self.ended, failure
                self.limits[rid] = min(self.limits.get(rid, 1 << 30), self.seen_produced[rid])
                self.inform(rid)
                continue
            assert rid not in self.known, f"failed request {rid} not dropped with its failure"
            assert failure.reason == FinishReason.TOKEN_LIMIT
            self.limits[rid] = min(self.limits.get(rid, 1 << 30), self.seen_produced[rid])
            self.informed.add(rid)
            self.end(rid, "failed")

    def on_plan_built(self, plan: StepPlan) -> None:
        if not self.params.async_mode and plan.plan_id > 0:
            prev = plan.plan_id - 1
            assert prev in self.step_done_seen, "sync plan built before StepDone of the last"
            assert len(self.processed_seen[prev]) == len(self.postprocs), (
                "sync plan built before every PlanProcessed of the last")
        assert plan.plan_id == self.plans_built
        self.plans_built += 1
        assert self.plans_built <= self.max_plans, "the scheduler keeps planning: livelock"
        assert self.must_drop <= set(plan.drop), (
            f"learned finishes {self.must_drop - set(plan.drop)} not dropped in the next plan")
        self.must_drop.clear()
        for rid in plan.drop:
            assert rid in self.known, f"drop of {rid}, which the worker does not know"
            self.known.remove(rid)
        for rid in plan.preempt:
            assert rid in self.known and rid not in self.informed
        for new in plan.new:
            assert new.request_id not in self.informed, "a finished request was restarted"
            assert new.resume == (new.request_id in self.known)
            self.known.add(new.request_id)
        for cont in plan.cont:
            assert cont.request_id in self.known and cont.request_id not in self.informed
        self.check_constraints_bounded(plan)
        self.worker_inbox.append(plan)

    def check_constraints_bounded(self, plan: StepPlan) -> None:
        """Running requests' constraints are held; besides those of the requests the worker
        runs in this plan, it keeps at most `guided_kept`."""
        self.paused = (self.paused | set(plan.preempt)) - {n.request_id for n in plan.new}
        held = set(self.sched.state.constraints.held)
        running = {r.sampling.guided_id for r in self.sched.state.running
                   if r.sampling.guided_kind != GuidedKind.NONE}
        assert running <= held, f"running requests' constraints {running - held} not held"
        at_worker = {self.guided_of[rid] for rid in self.known - self.paused
                     if rid in self.guided_of}
        assert len(held - at_worker) <= self.params.guided_kept, "too many unused constraints"

    def inform(self, rid: int) -> None:
        if rid in self.informed:
            return
        self.informed.add(rid)
        if rid in self.known:
            self.must_drop.add(rid)

    def end(self, rid: int, how: str) -> None:
        self.ended.setdefault(rid, how)
        self.ended_at_plan.setdefault(rid, self.plans_built)
        for postproc in self.postprocs:
            postproc.states.pop(rid, None)

    # ---------------------------------------------------------------- actions

    def arrive(self) -> None:
        msg, has_stop = self.arrivals.popleft()
        rid = msg.request_id
        self.postprocs[rid % len(self.postprocs)].states[rid] = PostprocState(has_stop)
        self.arrived_at_plan[rid] = self.plans_built
        gid = self.guided_of.get(rid)
        if self.ids_only and gid is not None:
            if self.guided_rng.random() < 0.05:
                self.sent.clear()  # as after a replaced set of roles: resent, or asked for
            if gid not in self.sent:
                self.sched.on_constraint(self.constraint_of[rid])
                self.sent.add(gid)
        rejected = self.sched.add_request(msg)
        assert rejected is None, rejected
        self.after_event()

    def run_worker(self) -> None:
        plan = self.worker_inbox.popleft()
        if self.params.pace_plans and self.params.async_mode:  # before its StepDone, in order
            self.from_worker.append(PlanEnding(plan.plan_id))
        done, steps = self.worker.run(plan)
        self.from_worker.append(done)
        for index, inbox in enumerate(self.postproc_inbox):
            mine = [[row for row in rows if row[0] % len(self.postprocs) == index]
                    for rows in steps]
            inbox.append((plan.plan_id, mine))

    def run_postproc(self, index: int) -> None:
        plan_id, steps = self.postproc_inbox[index].popleft()
        before = set(self.ended)
        self.from_postproc[index].extend(self.postprocs[index].process(plan_id, steps, self.ended))
        for rid in set(self.ended) - before:
            self.ended_at_plan[rid] = self.plans_built

    def deliver_step_done(self) -> None:
        done = self.from_worker.popleft()
        if isinstance(done, PlanEnding):
            assert done.plan_id == self.plans_built - 1, "paced: no plan built past an unended one"
            self.sched.on_plan_ending(done)
            self.after_event()
            return
        late = 1 if self.params.async_mode else 0
        assert self.plans_built - 1 - done.plan_id <= late, "too many plans outstanding"
        self.step_done_seen.add(done.plan_id)
        for rid, num in zip(done.request_ids.tolist(), done.num_tokens.tolist(), strict=False):
            self.seen_produced[rid] += num
        self.sched.on_step_done(done)
        for rid in done.finished_ids.tolist():
            self.inform(rid)
        self.after_event()

    def deliver_from_postproc(self, index: int) -> None:
        msg = self.from_postproc[index].popleft()
        if isinstance(msg, StopHit):
            self.limits[msg.request_id] = min(self.limits.get(msg.request_id, 1 << 30),
                                              msg.num_tokens)
            self.sched.on_stop_hit(msg)
            self.inform(msg.request_id)
        else:
            self.processed_seen[msg.plan_id].add(msg.worker_index)
            self.sched.on_plan_processed(msg)
        self.after_event()

    def abort(self, rid: int) -> None:
        self.limits[rid] = min(self.limits.get(rid, 1 << 30), self.seen_produced[rid])
        self.sched.abort_request(rid)
        self.inform(rid)
        self.end(rid, "abort")
        self.after_event()

    def live_requests(self) -> list[int]:
        arrived = self.arrived_at_plan
        return [rid for rid in arrived if rid not in self.ended]

    def queued_plan_request(self) -> int | None:
        """A live request inside the plan queued last at the worker, if any."""
        if not self.worker_inbox:
            return None
        ids = [n.request_id for n in self.worker_inbox[-1].new if n.request_id not in self.ended]
        return self.rng.choice(ids) if ids else None

    def actions(self) -> list[tuple[float, object]]:
        acts: list[tuple[float, object]] = []
        if self.arrivals:
            acts.append((0.4, self.arrive))
        if self.worker_inbox:
            acts.append((1.0, self.run_worker))
        if self.from_worker:
            acts.append((1.0, self.deliver_step_done))
        if self.wanted:
            acts.append((0.5, self.answer_wanted))
        for i in range(len(self.postprocs)):
            if self.postproc_inbox[i]:
                acts.append((0.7, lambda i=i: self.run_postproc(i)))
            if self.from_postproc[i]:
                acts.append((1.0, lambda i=i: self.deliver_from_postproc(i)))
        return acts

    def step(self) -> bool:
        if self.rng.random() < self.p_abort:
            live = self.live_requests()
            in_queued_plan = self.queued_plan_request()
            if in_queued_plan is not None and self.rng.random() < 0.5:
                self.abort(in_queued_plan)
                return True
            if live:
                self.abort(self.rng.choice(live))
                return True
        acts = self.actions()
        if not acts:
            return False
        weights = [w for w, _ in acts]
        action = self.rng.choices([a for _, a in acts], weights)[0]
        action()  # type: ignore[operator]
        return True

    def run(self) -> Simulation:
        while self.step():
            pass
        self.check_end()
        return self

    # ---------------------------------------------------------------- end state

    def check_end(self) -> None:
        sched, stats = self.sched, self.sched.stats
        unfinished = [rid for rid in self.arrived_at_plan if rid not in self.ended]
        assert not unfinished, f"requests never finished (deadlock): {unfinished[:10]}"
        assert len(self.ended) == self.num_requests
        assert not sched.ready_to_plan()
        assert stats.num_waiting == stats.num_running == stats.plans_outstanding == 0
        assert stats.num_free_blocks == self.params.num_blocks, "blocks leaked"
        assert not self.worker.reqs, f"worker still holds {list(self.worker.reqs)}"
        assert not self.known and not self.must_drop and not self.worker.count_drop_due
        assert self.worker.tables == set(sched.state.constraints.held), \
            "worker and scheduler differ"
        assert len(self.worker.tables) <= self.params.guided_kept
        if self.p_guided > 0:
            assert self.worker.tables_sent > len(self.worker.tables), "constraints were sent"
        produced = self.worker.produced_total
        assert stats.tokens_delivered + stats.tokens_after_finish == produced
        expected = sum(min(n, self.limits.get(rid, n)) for rid, n in self.seen_produced.items())
        assert stats.tokens_delivered == expected
        assert len(sched.state.ledger) == 0, "token tallies outlive their requests"
        waits = [self.ended_at_plan[rid] - self.arrived_at_plan[rid] for rid in self.ended]
        assert max(waits) <= self.max_wait_plans(), f"a request waited {max(waits)} plans"
        sched.check_invariants()

    def max_wait_plans(self) -> int:
        # Generous: every request ahead of it runs to its limits one at a time.
        per_request = self.params.max_model_len * 2 // self.params.num_steps + 4
        return self.num_requests * per_request


def small_cache(num_steps: int, async_mode: bool, **overrides: object) -> SchedulerParams:
    values: dict[str, object] = dict(
        num_blocks=24, block_size=4, num_steps=num_steps, max_model_len=48, max_num_seqs=8,
        max_num_batched_tokens=24, async_mode=async_mode, num_postproc_workers=2,
        guided_kept=2)  # fewer than the constraints the requests use: some are resent
    values.update(overrides)
    return SchedulerParams(**values)  # type: ignore[arg-type]
