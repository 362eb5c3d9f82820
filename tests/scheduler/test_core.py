"""The scheduler driven by a scripted fake gpu worker and fake postproc workers.

The fake worker follows the gpu worker's rules exactly (persistent per-request state, K
decode steps for every decoding request, its own finishes at EOS / max_new_tokens /
max_model_len) and checks what it is told: no prefill past len - 1, no block it does not own,
never fewer blocks than its next writes need, and the KV it reads is the KV that was written
for exactly that prefix (every cache slot holds a hash chained over the tokens before it).
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import pytest

from proto.messages import (
    AddRequest,
    FinishReason,
    PlanEnding,
    PlanProcessed,
    SamplingParams,
    StepDone,
    StepPlan,
    StopHit,
)
from scheduler.core import Scheduler, SchedulerParams

VOCAB = 50
MOD = (1 << 61) - 1
Row = tuple[int, int, int]  # request id, token id, finish reason


def kv_value(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % MOD


def kv_values_of(tokens: list[int]) -> list[int]:
    values, prev = [], 0
    for token in tokens:
        prev = kv_value(prev, token)
        values.append(prev)
    return values


# ====================================================================== fake gpu worker


@dataclass
class WorkerRequest:
    history: list[int]
    kv_values: list[int]  # what a correct KV cache holds at each history position
    prompt_len: int
    max_new: int
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    chunk: int = 0
    finish: FinishReason = FinishReason.NOT_FINISHED

    @property
    def finished(self) -> bool:
        return self.finish != FinishReason.NOT_FINISHED

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return not self.finished and self.num_computed == len(self.history) - 1


class FakeWorker:
    def __init__(self, params: SchedulerParams, rng: random.Random, p_eos: float) -> None:
        self.params = params
        self.rng = rng
        self.p_eos = p_eos
        self.kv = np.full((params.num_blocks, params.block_size), -1, dtype=np.int64)
        self.reqs: dict[int, WorkerRequest] = {}
        self.finished_in: dict[int, int] = {}  # request id -> plan in which the worker ended it
        self.count_drop_due: dict[int, int] = {}  # request id -> plan that must drop it
        self.produced_total = 0

    def run(self, plan: StepPlan) -> tuple[StepDone, list[list[Row]]]:
        for rid, due in list(self.count_drop_due.items()):
            if due == plan.plan_id:
                assert rid in plan.drop, f"count-finished {rid} not dropped in plan {due}"
                del self.count_drop_due[rid]
        again = self._apply(plan)
        self._check_before_forwards()
        self._prefill()
        steps, produced, finished = self._decode(plan)
        for rid in again:
            finished.setdefault(rid, self.reqs[rid].finish)
        done = StepDone(
            plan_id=plan.plan_id,
            request_ids=np.array(list(produced), dtype=np.int64),
            num_tokens=np.array(list(produced.values()), dtype=np.int32),
            finished_ids=np.array(list(finished), dtype=np.int64),
            finish_reasons=np.array([int(r) for r in finished.values()], dtype=np.uint8),
            forward_time=0.0,
            wall_time=0.0,
        )
        return done, steps

    def _apply(self, plan: StepPlan) -> list[int]:
        late = 0 if not self.params.async_mode else 1
        for rid in plan.drop:
            assert rid in self.reqs, f"plan {plan.plan_id} drops unknown request {rid}"
            del self.reqs[rid]
        for rid in plan.preempt:
            req = self.reqs[rid]
            req.table, req.num_computed, req.chunk = [], 0, 0
        named: list[int] = []
        for new in plan.new:
            if new.resume:
                req = self.reqs[new.request_id]
                assert not req.table and new.sampling is None and len(new.prompt_ids) == 0
            else:
                assert new.request_id not in self.reqs, f"{new.request_id} added twice"
                assert new.sampling is not None
                prompt = [int(t) for t in new.prompt_ids]
                req = WorkerRequest(prompt, kv_values_of(prompt), len(prompt),
                                    new.sampling.max_new_tokens)
                self.reqs[new.request_id] = req
            req.table = list(new.block_ids)
            req.num_computed = new.num_cached_tokens
            req.chunk = new.num_prefill_tokens
            named.append(new.request_id)
        for cont in plan.cont:
            req = self.reqs[cont.request_id]
            req.table.extend(cont.new_block_ids)
            req.chunk = cont.num_prefill_tokens
            named.append(cont.request_id)
        again = [rid for rid in named if self.reqs[rid].finished]
        for rid in again:
            assert plan.plan_id <= self.finished_in[rid] + late, (
                f"request {rid} finished in plan {self.finished_in[rid]} is still named in "
                f"plan {plan.plan_id}")
        return again

    def _check_before_forwards(self) -> None:
        bs = self.params.block_size
        holders: dict[int, list[tuple[WorkerRequest, int]]] = defaultdict(list)
        live = [req for req in self.reqs.values() if not req.finished and req.table]
        assert len(live) <= self.params.max_num_seqs, f"{len(live)} requests running"
        num_batched = sum(req.chunk + (req.num_computed + req.chunk == len(req.history) - 1)
                          for req in live)
        assert num_batched <= self.params.max_num_batched_tokens, f"{num_batched} tokens batched"
        for req in self.reqs.values():
            if req.finished:
                continue  # masked: writes nothing, and its blocks may already be reused
            assert len(set(req.table)) == len(req.table), "a block twice in one table"
            assert req.num_computed + req.chunk <= len(req.history) - 1 or req.chunk == 0, (
                f"prefill past len - 1: computed {req.num_computed} + chunk {req.chunk}, "
                f"history {len(req.history)}")
            needed = self._positions_needed(req)
            assert len(req.table) == -(-needed // bs), (
                f"{len(req.table)} blocks for {needed} positions: the rule needs exactly "
                f"{-(-needed // bs)}")
            for index, block in enumerate(req.table):
                assert 0 <= block < self.params.num_blocks
                holders[block].append((req, index))
            for pos in range(req.num_computed):
                assert self.kv[req.table[pos // bs], pos % bs] == req.kv_values[pos], (
                    f"stale KV at position {pos}")
        for block, owners in holders.items():
            if len(owners) > 1:  # only a fully computed shared prefix block may be shared
                for req, index in owners:
                    assert (index + 1) * bs <= req.num_computed, f"block {block} shared unsafely"

    def _positions_needed(self, req: WorkerRequest) -> int:
        after_prefill = req.num_computed + req.chunk
        if after_prefill < len(req.history) - 1:
            return after_prefill
        return after_prefill + self._steps_left(req)

    def _steps_left(self, req: WorkerRequest) -> int:
        return min(self.params.num_steps, req.max_new - req.generated,
                   self.params.max_model_len - len(req.history))

    def _write(self, req: WorkerRequest, pos: int) -> None:
        bs = self.params.block_size
        assert pos // bs < len(req.table), f"write at {pos} outside {len(req.table)} blocks"
        self.kv[req.table[pos // bs], pos % bs] = req.kv_values[pos]

    def _prefill(self) -> None:
        for req in self.reqs.values():
            if not req.finished:
                for pos in range(req.num_computed, req.num_computed + req.chunk):
                    self._write(req, pos)
                req.num_computed += req.chunk
            req.chunk = 0

    def _decode(self, plan: StepPlan) -> tuple[list[list[Row]], Counter[int], dict[int, int]]:
        steps: list[list[Row]] = []
        produced: Counter[int] = Counter()
        finished: dict[int, int] = {}
        for _ in range(plan.num_steps):
            rows: list[Row] = []
            for rid, req in self.reqs.items():
                if not req.decoding:
                    continue
                self._write(req, req.num_computed)
                token = self.rng.randrange(VOCAB)
                req.history.append(token)
                req.kv_values.append(kv_value(req.kv_values[-1], token))
                req.num_computed += 1
                produced[rid] += 1
                self.produced_total += 1
                req.finish = self._finish_reason(req)
                if req.finished:
                    finished[rid] = req.finish
                    self.finished_in[rid] = plan.plan_id
                    if req.finish != FinishReason.EOS_TOKEN:
                        self.count_drop_due[rid] = plan.plan_id + 1
                rows.append((rid, token, int(req.finish)))
            steps.append(rows)
        return steps, produced, finished

    def _finish_reason(self, req: WorkerRequest) -> FinishReason:
        if self.rng.random() < self.p_eos:
            return FinishReason.EOS_TOKEN
        if req.generated >= req.max_new:
            return FinishReason.MAX_TOKENS
        if len(req.history) >= self.params.max_model_len:
            return FinishReason.TOKEN_LIMIT
        return FinishReason.NOT_FINISHED


# ====================================================================== fake postproc


@dataclass
class PostprocState:
    has_stop: bool
    generated: int = 0
    done: bool = False


class FakePostproc:
    def __init__(self, index: int, rng: random.Random, p_stop: float) -> None:
        self.index = index
        self.rng = rng
        self.p_stop = p_stop
        self.states: dict[int, PostprocState] = {}

    def process(self, plan_id: int, steps: list[list[Row]],
                ended: dict[int, str]) -> list[StopHit | PlanProcessed]:
        out: list[StopHit | PlanProcessed] = []
        for rows in steps:
            for rid, _token, finish in rows:
                state = self.states.get(rid)
                if state is None or state.done:
                    continue  # not ours, forgotten, or past its stop string
                state.generated += 1
                if state.has_stop and self.rng.random() < self.p_stop:
                    state.done = True
                    out.append(StopHit(rid, state.generated))
                    ended.setdefault(rid, "stop")
                elif finish:
                    state.done = True
                    ended.setdefault(rid, "worker")
        out.append(PlanProcessed(plan_id, self.index))
        return out


# ====================================================================== the harness


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

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.sched = Scheduler(self.params)
        self.worker = FakeWorker(self.params, random.Random(self.seed + 1), self.p_eos)
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
            msg = AddRequest(1000 + rid, np.array(prompt, dtype=np.int32), sampling, float(rid))
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

    def take_failures(self) -> None:
        for failure in self.sched.take_failures():
            rid = failure.request_id
            assert rid not in self.known, f"failed request {rid} not dropped with its failure"
            assert failure.reason == FinishReason.TOKEN_LIMIT and failure.message
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
        self.worker_inbox.append(plan)

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
        produced = self.worker.produced_total
        assert stats.tokens_delivered + stats.tokens_after_finish == produced
        expected = sum(min(n, self.limits.get(rid, n)) for rid, n in self.seen_produced.items())
        assert stats.tokens_delivered == expected
        assert len(sched._ledger) == 0, "token tallies outlive their requests"
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
        max_num_batched_tokens=24, async_mode=async_mode, num_postproc_workers=2)
    values.update(overrides)
    return SchedulerParams(**values)  # type: ignore[arg-type]


# ====================================================================== the random runs


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_random_workload_small_cache(num_steps: int, async_mode: bool) -> None:
    sim = Simulation(small_cache(num_steps, async_mode), seed=num_steps * 10 + async_mode).run()
    stats = sim.sched.stats
    assert stats.num_preemptions > 0, "the small cache should force preemptions"
    assert stats.prefix_hit_tokens > 0 and stats.prefix_hit_blocks > 0
    assert stats.prefix_query_tokens >= stats.prefix_hit_tokens
    if async_mode or num_steps > 1:  # sync K=1 learns every stop before the next step
        assert stats.tokens_after_finish > 0, "late stop strings waste some tokens"
    assert stats.num_failed > 0, "prompts at max_model_len fail"
    hows = Counter(sim.ended.values())
    assert hows["stop"] and hows["worker"] and hows["abort"]


@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_random_workload_paced_planning(num_steps: int) -> None:
    params = small_cache(num_steps, True, pace_plans=True)
    stats = Simulation(params, seed=num_steps * 7 + 1).run().sched.stats
    assert stats.num_preemptions > 0 and stats.num_failed > 0


def test_random_workload_without_prefix_caching() -> None:
    params = small_cache(4, True, enable_prefix_caching=False)
    stats = Simulation(params, seed=5).run().sched.stats
    assert stats.prefix_hit_tokens == stats.prefix_query_tokens == stats.num_cached_blocks == 0


def test_random_workload_roomy_cache_one_postproc() -> None:
    params = small_cache(4, True, num_blocks=400, max_num_seqs=32, num_postproc_workers=1,
                         max_num_batched_tokens=64)
    stats = Simulation(params, seed=11).run().sched.stats
    assert stats.num_preemptions == 0
    assert stats.prefix_hit_tokens > 0


def test_random_workload_cache_smaller_than_one_request() -> None:
    # 28 cache slots against max_model_len 48: long requests fail at admission or mid-way.
    params = small_cache(4, True, num_blocks=7, max_num_batched_tokens=10)
    stats = Simulation(params, seed=2, num_requests=60).run().sched.stats
    assert stats.num_failed > 0 and stats.num_preemptions > 0


def test_random_workload_tight_budget() -> None:
    # A token budget barely above the batch size: prefills crawl along in tiny chunks.
    params = small_cache(2, False, max_num_seqs=4, max_num_batched_tokens=5, num_blocks=40)
    Simulation(params, seed=3, num_requests=60).run()


# ====================================================================== scripted cases


def add(sched: Scheduler, rid: int, prompt: list[int] | int, max_new: int = 8) -> None:
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    msg = AddRequest(rid, np.array(ids, dtype=np.int32), SamplingParams(max_new_tokens=max_new),
                     0.0)
    assert sched.add_request(msg) is None


def step_done(plan_id: int, finished: dict[int, FinishReason] | None = None,
              tokens: dict[int, int] | None = None) -> StepDone:
    finished, tokens = finished or {}, tokens or {}
    return StepDone(plan_id, np.array(list(tokens), dtype=np.int64),
                    np.array(list(tokens.values()), dtype=np.int32),
                    np.array(list(finished), dtype=np.int64),
                    np.array([int(r) for r in finished.values()], dtype=np.uint8), 0.0, 0.0)


def params(**overrides: object) -> SchedulerParams:
    values: dict[str, object] = dict(num_blocks=64, block_size=4, num_steps=4, max_model_len=64,
                                     num_postproc_workers=1)
    values.update(overrides)
    return SchedulerParams(**values)  # type: ignore[arg-type]


def test_admission_rejects_beyond_the_queue_limits() -> None:
    sched = Scheduler(params(max_queued_requests=2, max_queued_tokens=25))
    add(sched, 1, 10)
    add(sched, 2, 10)
    msg = AddRequest(3, np.ones(3, np.int32), SamplingParams(), 0.0)
    rejected = sched.add_request(msg)
    assert rejected is not None and rejected.request_id == 3
    assert "max_queued_requests=2" in rejected.message

    sched = Scheduler(params(max_queued_tokens=25))
    add(sched, 1, 10)
    add(sched, 2, 10)
    rejected = sched.add_request(AddRequest(3, np.ones(6, np.int32), SamplingParams(), 0.0))
    assert rejected is not None and "max_queued_tokens=25" in rejected.message
    add(sched, 4, 5)  # still fits exactly
    assert sched.stats.num_rejected == 1 and sched.stats.num_waiting == 3
    sched.check_invariants()


def test_requests_that_can_never_run_fail_with_the_limit_named() -> None:
    sched = Scheduler(params(num_blocks=4, max_model_len=32))
    add(sched, 1, 32)
    add(sched, 2, 20)  # 20 positions need 5 blocks of 4
    add(sched, 3, 3, max_new=0)
    failures = {f.request_id: f for f in sched.take_failures()}
    assert "max_model_len=32" in failures[1].message
    assert "num_blocks=4" in failures[2].message
    assert "max_new_tokens" in failures[3].message
    assert not sched.ready_to_plan() and sched.take_failures() == []


def test_a_request_outgrowing_the_whole_cache_fails_and_is_dropped() -> None:
    sched = Scheduler(params(num_blocks=3, num_steps=1, max_model_len=64))
    add(sched, 1, 5, max_new=30)
    plan_ids = []
    while sched.ready_to_plan():
        plan = sched.build_plan()
        plan_ids.append(plan.plan_id)
        sched.on_step_done(step_done(plan.plan_id))
        sched.on_plan_processed(PlanProcessed(plan.plan_id, 0))
        if plan.drop:
            break
    [failure] = sched.take_failures()
    assert failure.request_id == 1 and "num_blocks=3" in failure.message
    assert plan.drop == [1] and not plan.cont
    assert sched.stats.num_free_blocks == 3
    sched.check_invariants()


def test_count_finish_is_dropped_in_the_next_plan_and_its_blocks_reused() -> None:
    sched = Scheduler(params(num_blocks=2, num_steps=4))
    add(sched, 1, 3, max_new=2)  # positions 0..3 (the last token is never computed): 1 block
    add(sched, 2, 5, max_new=1)  # positions 0..4: 2 blocks, so it waits for request 1's
    plan0 = sched.build_plan()
    assert [n.request_id for n in plan0.new] == [1]
    assert sched.stats.num_free_blocks == 2, "request 1 finishes in plan 0 by counts alone"
    plan1 = sched.build_plan()
    assert plan1.drop == [1] and [n.request_id for n in plan1.new] == [2]
    assert plan0.new[0].block_ids[0] in plan1.new[0].block_ids
    plan2 = sched.build_plan() if sched.ready_to_plan() else None
    assert plan2 is None, "two plans are outstanding"
    sched.on_step_done(step_done(0, {1: FinishReason.MAX_TOKENS}, {1: 2}))
    assert sched.build_plan().drop == [2]
    assert sched.stats.num_free_blocks == 2


def test_async_mode_keeps_one_plan_queued_and_sync_mode_waits_for_postproc() -> None:
    sched = Scheduler(params(num_postproc_workers=2))
    add(sched, 1, 4, max_new=40)
    sched.build_plan()
    sched.build_plan()
    assert not sched.ready_to_plan() and sched.stats.plans_outstanding == 2
    sched.on_step_done(step_done(0))
    assert sched.ready_to_plan()

    sched = Scheduler(params(num_postproc_workers=2, async_mode=False))
    add(sched, 1, 4, max_new=40)
    plan = sched.build_plan()
    assert not plan.publish_per_step and not sched.ready_to_plan()
    sched.on_plan_processed(PlanProcessed(0, 1))
    sched.on_step_done(step_done(0))
    assert not sched.ready_to_plan(), "worker 0 has not processed plan 0 yet"
    sched.on_plan_processed(PlanProcessed(0, 0))
    assert sched.ready_to_plan()


def test_paced_planning_builds_the_next_plan_once_the_running_one_is_ending() -> None:
    sched = Scheduler(params(pace_plans=True))
    add(sched, 1, 4, max_new=40)
    plan0 = sched.build_plan()
    add(sched, 2, 4, max_new=40)
    assert not sched.ready_to_plan(), "plan 0 has just started: later arrivals may join plan 1"
    add(sched, 3, 4, max_new=40)
    sched.on_plan_ending(PlanEnding(plan0.plan_id))
    plan1 = sched.build_plan()
    assert {n.request_id for n in plan1.new} == {2, 3}
    assert not sched.ready_to_plan() and sched.stats.plans_outstanding == 2
    sched.on_step_done(step_done(0, tokens={1: 4}))
    assert not sched.ready_to_plan(), "plan 1 is running and not ending yet"
    sched.on_plan_ending(PlanEnding(plan1.plan_id))
    assert sched.ready_to_plan()
    sched.on_plan_ending(PlanEnding(0))  # a plan already done: nothing changes
    assert sched.ready_to_plan()
    with pytest.raises(ValueError, match="plan 7 was never built"):
        sched.on_plan_ending(PlanEnding(7))
    sched.build_plan()
    sched.on_step_done(step_done(1, tokens={1: 4, 2: 4, 3: 4}))
    sched.on_step_done(step_done(2, tokens={1: 4, 2: 4, 3: 4}))
    assert sched.ready_to_plan(), "nothing running: plan at once"

    sync = Scheduler(params(pace_plans=True, async_mode=False, num_postproc_workers=1))
    add(sync, 1, 4, max_new=40)
    sync.build_plan()
    sync.on_step_done(step_done(0, tokens={1: 4}))
    sync.on_plan_processed(PlanProcessed(0, 0))
    assert sync.ready_to_plan(), "sync mode never waits for PlanEnding"


def test_a_late_finish_is_dropped_in_the_next_built_plan() -> None:
    sched = Scheduler(params())
    add(sched, 1, 4, max_new=40)
    add(sched, 2, 4, max_new=40)
    sched.build_plan()
    plan1 = sched.build_plan()
    assert plan1.drop == []
    free_before = sched.stats.num_free_blocks
    sched.on_step_done(step_done(0, {1: FinishReason.EOS_TOKEN}, {1: 3, 2: 4}))
    assert sched.stats.num_free_blocks > free_before, "blocks come back at once"
    plan2 = sched.build_plan()
    assert plan2.drop == [1]
    assert all(c.request_id != 1 for c in plan2.cont)
    sched.on_step_done(step_done(1, {1: FinishReason.EOS_TOKEN}))  # reported again: ignored
    sched.check_invariants()


def test_prefix_blocks_are_shared_only_from_a_later_plan() -> None:
    sched = Scheduler(params(num_steps=1))
    prompt = list(range(100, 112))  # three full blocks
    add(sched, 1, prompt)
    add(sched, 2, [*prompt, 7, 7])
    plan0 = sched.build_plan()
    assert [n.num_cached_tokens for n in plan0.new] == [0, 0], "same plan: no sharing"
    add(sched, 3, [*prompt, 9])
    add(sched, 4, prompt)
    plan1 = sched.build_plan()
    cached = {n.request_id: n.num_cached_tokens for n in plan1.new}
    assert cached == {3: 12, 4: 8}, "at most len - 1 tokens come from the cache"
    new3 = next(n for n in plan1.new if n.request_id == 3)
    new1 = next(n for n in plan0.new if n.request_id == 1)
    assert new3.block_ids[:3] == new1.block_ids[:3]
    assert new3.num_prefill_tokens == 0, "only the last token is left: it is decoded"
    stats = sched.stats
    assert stats.prefix_hit_tokens == 20 and stats.prefix_hit_blocks == 5
    assert stats.prefix_query_tokens == 12 + 14 + 13 + 12
    sched.check_invariants()


def test_preemption_takes_the_newest_and_resumes_it_first() -> None:
    sched = Scheduler(params(num_blocks=6, num_steps=4, max_model_len=64,
                             enable_prefix_caching=False))
    add(sched, 1, 3, max_new=40)
    add(sched, 2, 3, max_new=40)
    add(sched, 3, 3, max_new=40)
    preempted: list[int] = []
    resumed: list[int] = []
    for plan_id in range(12):
        plan = sched.build_plan()
        preempted += plan.preempt
        resumed += [n.request_id for n in plan.new if n.resume]
        for new in plan.new:
            if new.resume:
                assert new.sampling is None and len(new.prompt_ids) == 0
                assert new.num_prefill_tokens > 0
        sched.on_step_done(step_done(plan_id))
        sched.on_plan_processed(PlanProcessed(plan_id, 0))
        sched.check_invariants()
    assert preempted and preempted[0] == 3, "the newest request goes first"
    assert sched.stats.num_preemptions == len(preempted)


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = Scheduler(params(max_num_batched_tokens=8, num_steps=1))
    add(sched, 1, 20)
    add(sched, 2, 3)
    chunks = []
    for plan_id in range(4):
        plan = sched.build_plan()
        total = sum(n.num_prefill_tokens for n in plan.new)
        total += sum(c.num_prefill_tokens for c in plan.cont)
        chunks.append(total)
        sched.on_step_done(step_done(plan_id))
        sched.on_plan_processed(PlanProcessed(plan_id, 0))
    assert all(c <= 8 for c in chunks)
    assert chunks[0] == 8 and sum(chunks[:3]) >= 19


def test_stop_hit_and_abort_count_tokens_made_after_the_finish() -> None:
    sched = Scheduler(params())
    add(sched, 1, 4, max_new=40)
    add(sched, 2, 4, max_new=40)
    sched.build_plan()
    sched.build_plan()
    sched.on_stop_hit(StopHit(1, 2))  # before the tokens it cuts were even reported
    sched.on_step_done(step_done(0, tokens={1: 4, 2: 4}))
    sched.abort_request(2)
    sched.abort_request(2)  # twice, and an unknown id: both ignored
    sched.abort_request(99)
    sched.on_step_done(step_done(1, tokens={1: 4, 2: 4}))
    stats = sched.stats
    assert stats.tokens_delivered == 2 + 4
    assert stats.tokens_after_finish == 2 + 4 + 4
    plan = sched.build_plan()
    assert sorted(plan.drop) == [1, 2]


def test_a_prefill_chunk_shrinks_to_the_blocks_left() -> None:
    sched = Scheduler(params(num_blocks=4, num_steps=1, max_num_batched_tokens=8,
                             enable_prefix_caching=False))
    add(sched, 1, 2, max_new=40)
    add(sched, 2, 13)  # completing needs all 4 blocks; only 3 can be had in plan 1
    sched.build_plan()
    sched.on_step_done(step_done(0))
    sched.on_plan_processed(PlanProcessed(0, 0))
    plan1 = sched.build_plan()
    [cont] = [c for c in plan1.cont if c.request_id == 2]
    assert cont.num_prefill_tokens == 5 and len(cont.new_block_ids) == 1
    sched.check_invariants()


def test_nobody_overtakes_the_head_of_the_queue() -> None:
    sched = Scheduler(params(num_blocks=4, num_steps=4, enable_prefix_caching=False))
    add(sched, 1, 9, max_new=40)  # 8 + 4 positions: 3 blocks
    add(sched, 2, 9)  # 3 blocks: has to wait
    add(sched, 3, 2)  # 1 block would fit, but request 2 came first
    plan = sched.build_plan()
    assert [n.request_id for n in plan.new] == [1]
    assert sched.stats.num_waiting == 2


def test_prompt_logprobs_requests_never_take_cached_prefix_blocks() -> None:
    sched = Scheduler(params(num_steps=1))
    prompt = list(range(100, 112))  # three full blocks
    add(sched, 1, prompt)
    sched.build_plan()  # request 1's prompt blocks are registered from here on
    scored = AddRequest(2, np.array([*prompt, 9], dtype=np.int32),
                        SamplingParams(max_new_tokens=8, prompt_logprobs=True), 0.0)
    assert sched.add_request(scored) is None
    add(sched, 3, [*prompt, 9])
    plan = sched.build_plan()
    new = {n.request_id: n for n in plan.new}
    assert new[2].num_cached_tokens == 0, "every prompt position must be computed to score it"
    assert new[2].num_prefill_tokens == len(prompt)
    assert new[3].num_cached_tokens == 12, "the same prompt without prompt logprobs hits"
    sched.check_invariants()
