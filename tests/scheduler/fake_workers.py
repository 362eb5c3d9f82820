"""Fake gpu and postproc workers for the scheduler simulation (see `simulation.py`).

The fake worker follows the gpu worker's rules exactly (persistent per-request state, K
decode steps for every decoding request, its own finishes at EOS / max_new_tokens /
max_model_len) and checks what it is told: no prefill past len - 1, no block it does not own,
never fewer blocks than its next writes need, and the KV it reads is the KV that was written
for exactly that prefix (every cache slot holds a hash chained over the tokens before it,
started from the request's LoRA adapter: KV computed under another adapter reads as stale).
With adapters it keeps the slot table the plans' loads build, and checks that a request runs
with its own adapter in its slot and that a load never replaces an adapter a request holds.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from tandem_serve.proto.guided_messages import GuidedTable
from tandem_serve.proto.plan_messages import StepDone, StepPlan
from tandem_serve.proto.request_params import FinishReason, GuidedKind
from tandem_serve.proto.token_messages import PlanProcessed, StopHit
from tandem_serve.scheduler.budget import piece_cost
from tandem_serve.scheduler.core import SchedulerParams

VOCAB = 50
MOD = (1 << 61) - 1
Row = tuple[int, int, int]  # request id, token id, finish reason


def kv_value(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % MOD


def kv_values_of(tokens: list[int], adapter: str = "") -> list[int]:
    values, prev = [], sum(map(ord, adapter)) * 7919 % MOD
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
    guided_id: str = ""  # the constraint it decodes under ("" = none)
    num_computed: int = 0
    chunk: int = 0
    pieces: list[int] = field(default_factory=list)  # the chunk per step (empty: step 0)
    finish: FinishReason = FinishReason.NOT_FINISHED
    adapter: str = ""
    lora_slot: int = 0

    @property
    def finished(self) -> bool:
        return self.finish != FinishReason.NOT_FINISHED

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return not self.finished and self.num_computed == len(self.history) - 1

    @property
    def join(self) -> int:
        """The step it starts decoding in once its chunk completes the prompt."""
        return max(0, len(self.pieces) - 1)


class FakeWorker:
    def __init__(self, params: SchedulerParams, rng: random.Random, p_eos: float) -> None:
        self.params = params
        self.rng = rng
        self.p_eos = p_eos
        self.kv = np.full((params.num_blocks, params.block_size), -1, dtype=np.int64)
        # The host KV tier's slots (scheduler/kv/host_tier.py): the plans' copies move KV here.
        self.host = np.full((params.num_host_blocks, params.block_size), -1, dtype=np.int64)
        self.copied = [0, 0]  # blocks offloaded, onloaded
        self.reqs: dict[int, WorkerRequest] = {}
        self.finished_in: dict[int, int] = {}  # request id -> plan in which the worker ended it
        self.count_drop_due: dict[int, int] = {}  # request id -> plan that must drop it
        self.produced_total = 0
        self.tables: set[str] = set()  # guided constraints held, as the plans said
        self.tables_sent = 0
        self.adapter_of: dict[int, str] = {}  # request id -> its adapter (the simulation's)
        self.slots: dict[int, str] = {}  # adapter slot -> adapter loaded there
        self.decoding_before = False  # a request decoded when the current plan started

    def run(self, plan: StepPlan) -> tuple[StepDone, list[list[Row]]]:
        for rid, due in list(self.count_drop_due.items()):
            if due == plan.plan_id:
                assert rid in plan.drop, f"count-finished {rid} not dropped in plan {due}"
                del self.count_drop_due[rid]
        self._copy(plan)  # before anything else of the plan, as the gpu worker does
        again = self._apply(plan)
        self._check_before_forwards(plan)
        self._prefill()
        steps, produced, finished = self._decode(plan)
        for req in self.reqs.values():
            req.pieces = []
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

    def _copy(self, plan: StepPlan) -> None:
        assert len(plan.offload_blocks) == len(plan.offload_slots)
        assert len(plan.onload_slots) == len(plan.onload_blocks)
        for block, slot in zip(plan.offload_blocks, plan.offload_slots, strict=True):
            assert (self.kv[block] != -1).all(), f"offloaded block {block} was never written"
            self.host[slot] = self.kv[block]
        for slot, block in zip(plan.onload_slots, plan.onload_blocks, strict=True):
            assert (self.host[slot] != -1).all(), f"onloaded slot {slot} was never written"
            self.kv[block] = self.host[slot]
        self.copied[0] += len(plan.offload_blocks)
        self.copied[1] += len(plan.onload_slots)

    def _apply(self, plan: StepPlan) -> list[int]:
        late = 0 if not self.params.async_mode else 1
        for rid in plan.drop:
            assert rid in self.reqs, f"plan {plan.plan_id} drops unknown request {rid}"
            del self.reqs[rid]
        for rid in plan.preempt:
            req = self.reqs[rid]
            req.table, req.num_computed, req.chunk, req.pieces = [], 0, 0, []
        # What the plan's budget saw decoding (the scheduler may not know of late finishes).
        self.decoding_before = any(r.table and not r.finish.value and len(r.history) - 1 ==
                                   r.num_computed for r in self.reqs.values())
        self._apply_constraints(plan)
        for load in plan.adapters:
            assert 1 <= load.slot <= self.params.max_loras, f"slot {load.slot}"
            users = [rid for rid, r in self.reqs.items() if r.lora_slot == load.slot
                     and not r.finished]
            assert not users, f"slot {load.slot} reloaded under requests {users}"
            self.slots[load.slot] = load.adapter_id
        named: list[int] = []
        for new in plan.new:
            if new.resume:
                req = self.reqs[new.request_id]
                assert not req.table and new.sampling is None and len(new.prompt_ids) == 0
            else:
                assert new.request_id not in self.reqs, f"{new.request_id} added twice"
                assert new.sampling is not None
                prompt = [int(t) for t in new.prompt_ids]
                adapter = self.adapter_of.get(new.request_id, "")
                req = WorkerRequest(prompt, kv_values_of(prompt, adapter), len(prompt),
                                    new.sampling.max_new_tokens, adapter=adapter,
                                    lora_slot=new.lora_slot)
                assert (new.lora_slot > 0) == bool(adapter), "adapter slot missing or stray"
                if new.sampling.guided_kind != GuidedKind.NONE:
                    req.guided_id = new.sampling.guided_id
                self.reqs[new.request_id] = req
            assert not req.guided_id or req.guided_id in self.tables, (
                f"request {new.request_id} starts without its constraint {req.guided_id}")
            req.table = list(new.block_ids)
            req.num_computed = new.num_cached_tokens
            req.chunk, req.pieces = new.num_prefill_tokens, list(new.prefill_steps)
            named.append(new.request_id)
        for cont in plan.cont:
            req = self.reqs[cont.request_id]
            req.table.extend(cont.new_block_ids)
            req.chunk, req.pieces = cont.num_prefill_tokens, list(cont.prefill_steps)
            named.append(cont.request_id)
        again = [rid for rid in named if self.reqs[rid].finished]
        for rid in again:
            assert plan.plan_id <= self.finished_in[rid] + late, (
                f"request {rid} finished in plan {self.finished_in[rid]} is still named in "
                f"plan {plan.plan_id}")
        return again

    def _apply_constraints(self, plan: StepPlan) -> None:
        for gid in plan.drop_tables:
            assert gid in self.tables, f"plan {plan.plan_id} drops {gid}, which it lacks"
            self.tables.remove(gid)
        for item in plan.tables:
            gid = item.table_id if isinstance(item, GuidedTable) else item.grammar_id
            assert gid not in self.tables, f"plan {plan.plan_id} resends {gid}"
            self.tables.add(gid)
            self.tables_sent += 1

    def _check_budget(self, live: list[WorkerRequest]) -> None:
        params = self.params
        if params.prefill_phase:  # one budget per plan: chunks plus one per decoding request
            num_batched = sum(req.chunk + (req.num_computed + req.chunk == len(req.history) - 1)
                              for req in live)
            assert num_batched <= params.max_num_batched_tokens, f"{num_batched} tokens batched"
            return
        k = params.num_steps
        loads = [0] * k
        for req in live:
            pieces = req.pieces or [req.chunk]
            assert len(pieces) <= k and sum(pieces) == req.chunk, f"pieces {pieces}"
            context = req.num_computed
            for step, n in enumerate(pieces):  # later pieces weigh more (their attention)
                loads[step] += piece_cost(n, context, params.attention_tokens)
                context += n
            if req.num_computed + req.chunk == len(req.history) - 1:
                for step in range(req.join, req.join + self._steps_left(req)):
                    loads[step] += 1
        caps = [params.max_num_batched_tokens] * k
        if not self.decoding_before:  # nothing decoding: the first step takes whole chunks
            caps[0] *= k
        assert all(n <= cap for n, cap in zip(loads, caps, strict=True)), (
            f"{loads} tokens per step over {caps}")

    def _check_before_forwards(self, plan: StepPlan) -> None:
        bs = self.params.block_size
        holders: dict[int, list[tuple[WorkerRequest, int]]] = defaultdict(list)
        live = [req for req in self.reqs.values() if not req.finished and req.table]
        assert len(live) <= self.params.max_num_seqs, f"{len(live)} requests running"
        assert plan.prefill_phase == self.params.prefill_phase
        self._check_budget(live)
        for req in self.reqs.values():
            if req.finished:
                continue  # masked: writes nothing, and its blocks may already be reused
            if req.adapter:
                assert self.slots.get(req.lora_slot) == req.adapter, (
                    f"runs with {self.slots.get(req.lora_slot)!r}, not its {req.adapter!r}")
            assert len(set(req.table)) == len(req.table), "a block twice in one table"
            assert req.num_computed + req.chunk <= len(req.history) - 1 or req.chunk == 0, (
                f"prefill past len - 1: computed {req.num_computed} + chunk {req.chunk}, "
                f"history {len(req.history)}")
            needed = self._positions_needed(req)
            if self.params.num_speculative_tokens:  # the lookahead is a bound, not exact
                assert len(req.table) >= -(-needed // bs), (
                    f"{len(req.table)} blocks for up to {needed} positions")
            else:
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
        k = self.params.num_speculative_tokens
        if k:  # every step may advance 1 + k positions, up to the request's limit
            limit = min(req.prompt_len + req.max_new, self.params.max_model_len)
            return min(after_prefill + self._steps_left(req) * (k + 1), limit)
        return after_prefill + self._steps_left(req)

    def _steps_left(self, req: WorkerRequest) -> int:
        """Decode steps it runs in this plan: from the step it starts in, to its limits."""
        return min(self.params.num_steps - req.join, req.max_new - req.generated,
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
        for step in range(plan.num_steps):
            rows: list[Row] = []
            for rid, req in self.reqs.items():
                if not req.decoding or step < req.join:
                    continue
                assert not req.guided_id or req.guided_id in self.tables, (
                    f"request {rid} decodes without its constraint {req.guided_id}")
                # Speculation: 1 to 1 + k tokens a step (accepted drafts and the bonus).
                for _ in range(self.rng.randint(1, 1 + self.params.num_speculative_tokens)):
                    rows.append(self._decode_one(plan, rid, req, produced, finished))
                    if req.finished:
                        break
            steps.append(rows)
        return steps, produced, finished

    def _decode_one(self, plan: StepPlan, rid: int, req: WorkerRequest,
                    produced: Counter[int], finished: dict[int, int]) -> Row:
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
            if req.finish != FinishReason.EOS_TOKEN and not self.params.num_speculative_tokens:
                self.count_drop_due[rid] = plan.plan_id + 1
        return (rid, token, int(req.finish))

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
