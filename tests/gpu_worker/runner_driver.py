"""A scripted scheduler around one ModelRunner, and the checkpoints the runner tests use.

`Driver` plays the scheduler (blocks from a shuffled free list, sized exactly as the scheduler
sizes them, plan deltas, drops of finished requests) and collects what the runner publishes
through a real `TokenPublisher` into a list.  Every plan's TokenBatches and StepDone are
checked against each other (counts, finishes, masking after a finish).
"""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem_serve.gpu_worker.publisher import TokenPublisher
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.proto.adapter_messages import AdapterLoad
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.proto.plan_messages import ContinueRequest, NewRequest, StepDone, StepPlan
from tandem_serve.proto.request_params import FinishReason, ImageInput, SamplingParams
from tandem_serve.proto.token_messages import PromptDetail, TokenBatch
from tests.gpu_worker.model_utils import EOS_ID, HFReference, make_tiny_checkpoint, random_prompts

NEW_TOKENS = 24


@dataclass
class Tracked:
    prompt: list[int]
    sampling: SamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # KV positions the worker holds
    chunk: int = 0  # prefill tokens in the next plan
    out: list[int] = field(default_factory=list)
    finish: FinishReason = FinishReason.NOT_FINISHED
    paused: bool = False  # preempted and not resumed yet
    gone: bool = False  # dropped from the worker (finished or aborted)
    lora_slot: int = 0  # its adapter slot (0: the base model)
    steps: list[int] = field(default_factory=list)  # next plan's chunk per step ([]: step 0)
    images: list[ImageInput] = field(default_factory=list)  # a VL model's prompt images

    @property
    def history(self) -> list[int]:
        return self.prompt + self.out

    def steps_left(self, max_model_len: int) -> int:
        limit = min(len(self.prompt) + self.sampling.max_new_tokens, max_model_len)
        return limit - len(self.history)


class Driver:
    """A scripted scheduler around one ModelRunner; `run(k)` executes one plan."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.refs: Counter[int] = Counter()
        self.reqs: dict[int, Tracked] = {}
        self.messages: list[TokenBatch | PromptDetail] = []
        self.pub = TokenPublisher(self.messages.append, runner.device)
        self.plan_id = 0
        self._new: list[tuple[int, bool, int]] = []  # (id, resume, cached tokens)
        self._drop: list[int] = []
        self._preempt: list[int] = []
        self._tables: list[GuidedTable | GuidedGrammar] = []
        self._drop_tables: list[str] = []
        self._loads: list[AdapterLoad] = []
        self.done: list[StepDone] = []
        spec = runner.speculation  # a verify step advances a row by up to 1 + k positions
        self.stride = spec.stride if spec is not None else 1
        if spec is not None:  # every eligible row speculates (the cost rule has its own tests)
            spec.policy.always = True

    # -- deltas for the next plan

    def add(self, rid: int, prompt: list[int], sampling: SamplingParams | None = None,
            chunk: int | None = None, shared: list[int] | None = None,
            cached: int = 0, lora_slot: int = 0, images: list[ImageInput] | None = None
            ) -> None:
        """A new request; `shared` blocks (another request's) hold its first `cached` tokens."""
        sampling = sampling or SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=[EOS_ID])
        t = Tracked(list(prompt), sampling, computed=cached, lora_slot=lora_slot,
                    images=list(images or []))
        for b in shared or []:
            self.refs[b] += 1
            t.blocks.append(b)
        t.chunk = len(prompt) - 1 - cached if chunk is None else chunk
        self.reqs[rid] = t
        self._new.append((rid, False, cached))

    def resume(self, rid: int, chunk: int | None = None) -> None:
        t = self.reqs[rid]
        t.paused = False
        t.chunk = len(t.history) - 1 if chunk is None else chunk
        self._new.append((rid, True, 0))

    def load(self, slot: int, adapter_id: str) -> None:
        """Load an adapter (a folder under the runner's adapter cache) in the next plan."""
        self._loads.append(AdapterLoad(slot, adapter_id))

    def prefill(self, rid: int, chunk: int, steps: list[int] | None = None) -> None:
        """`chunk` more prompt tokens in the next plan; `steps`: its pieces per step (the
        request then joins the decode rows in its last piece's step)."""
        self.reqs[rid].chunk = chunk
        self.reqs[rid].steps = list(steps or [])

    def preempt(self, rid: int) -> None:
        t = self.reqs[rid]
        self._release(t)
        t.computed, t.chunk, t.paused = 0, 0, True
        self._preempt.append(rid)

    def drop(self, rid: int) -> None:
        t = self.reqs[rid]
        self._release(t)
        t.gone = True
        self._drop.append(rid)

    def send_table(self, table: GuidedTable | GuidedGrammar) -> None:
        """A guided constraint for the next plan (the scheduler sends each once)."""
        self._tables.append(table)

    def drop_table(self, table_id: str) -> None:
        self._drop_tables.append(table_id)

    def _release(self, t: Tracked) -> None:
        for b in t.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)  # LIFO: the next request reuses (overwrites) it first
        t.blocks = []

    def _grow(self, t: Tracked, k: int) -> list[int]:
        """Blocks for this plan's writes, exactly as many as the scheduler would give."""
        positions = t.computed + t.chunk
        if positions == len(t.history) - 1:
            positions += min(k * self.stride, t.steps_left(self.runner.max_model_len))
        new = []
        while len(t.blocks) * self.bs < positions:
            b = self.free.pop()
            self.refs[b] += 1
            t.blocks.append(b)
            new.append(b)
        return new

    # -- one plan

    def run(self, k: int, per_step: bool = True, ending: Callable[[], None] | None = None,
            lead_s: float = 0.0) -> StepDone:
        for rid, t in self.reqs.items():  # the scheduler drops finishes in the next plan
            if t.finish and not t.gone:
                self.drop(rid)
        plan = StepPlan(self.plan_id, k, drop=self._drop, preempt=self._preempt,
                        publish_per_step=per_step, tables=self._tables,
                        drop_tables=self._drop_tables, adapters=self._loads)
        fresh = {rid for rid, _, _ in self._new}
        for rid, resume, cached in self._new:
            t = self.reqs[rid]
            grown = self._grow(t, k)
            del grown
            plan.new.append(NewRequest(
                rid, np.zeros(0, np.int32) if resume else np.array(t.prompt, np.int32),
                None if resume else t.sampling, list(t.blocks), cached, t.chunk, resume,
                t.lora_slot, list(t.steps), [] if resume else t.images))
        for rid, t in self.reqs.items():
            if rid in fresh or t.paused or t.gone:
                continue
            grown = self._grow(t, k)
            if grown or t.chunk:
                plan.cont.append(ContinueRequest(rid, grown, t.chunk, list(t.steps)))
        self._new, self._drop, self._preempt, self._loads = [], [], [], []
        self._tables, self._drop_tables = [], []
        first = len(self.messages)
        done = self.runner.execute(plan, self.pub, ending, lead_s)
        self._check_and_record(plan, self.messages[first:], done)
        self.plan_id += 1
        self.done.append(done)
        return done

    def _check_and_record(self, plan: StepPlan, msgs: list[Any], done: StepDone) -> None:
        batches = [m for m in msgs if isinstance(m, TokenBatch)]
        assert batches and batches[-1].last and all(not b.last for b in batches[:-1])
        assert all(b.plan_id == plan.plan_id for b in batches)
        got: dict[int, int] = Counter()
        finished: dict[int, FinishReason] = {}
        if batches[0].step >= 0:
            # Verify steps publish 1 + k batches each; plans where no row speculates, one.
            assert [b.step for b in batches] in (
                list(range(plan.num_steps * self.stride)), list(range(plan.num_steps)))
        # A row whose chunk was spread over steps decodes from its last piece's step on.
        joins = {rid: (len(t.steps) - 1) * self.stride for rid, t in self.reqs.items()
                 if t.steps}
        for b in batches:
            for rid, tok, fin in zip(b.request_ids.tolist(), b.token_ids.tolist(),
                                     b.finish.tolist(), strict=True):
                assert not self.reqs[rid].gone, f"dropped request {rid} is still decoding"
                if rid in finished or self.reqs[rid].finish:
                    assert tok == -1, f"request {rid} got a token after it finished"
                    continue
                if tok < 0 and self.stride > 1:  # a verify step's run ended before this column
                    continue
                if tok < 0 and b.step < joins.get(rid, 0):
                    continue
                assert tok >= 0
                self.reqs[rid].out.append(tok)
                got[rid] += 1
                if fin:
                    finished[rid] = FinishReason(fin)
        counts = dict(zip(done.request_ids.tolist(), done.num_tokens.tolist(), strict=True))
        assert {r: n for r, n in counts.items() if n} == dict(got)
        reported = dict(zip(done.finished_ids.tolist(), done.finish_reasons.tolist(),
                            strict=True))
        for rid, reason in finished.items():
            assert reported[rid] == reason
            self.reqs[rid].finish = reason
        for rid, reason in reported.items():  # never ran: its adapter failed to load
            if reason == FinishReason.ERROR:
                assert rid not in got
                self.reqs[rid].finish = FinishReason.ERROR
        for rid, t in self.reqs.items():  # what the worker computed in this plan
            if t.gone:
                continue
            if rid in counts:
                t.computed = len(t.history) - 1
            elif not t.paused:
                t.computed += t.chunk
            t.chunk, t.steps = 0, []

    def run_until_done(self, ks: list[int]) -> None:
        i = 0
        while any(not (t.finish or t.paused or t.gone) for t in self.reqs.values()):
            self.run(ks[i % len(ks)])
            i += 1
            assert i < 200

    def outputs(self) -> dict[int, list[int]]:
        return {rid: t.out for rid, t in self.reqs.items()}


# name -> (arch, checkpoint kwargs): every architecture, GQA 2/4/1, tied and untied heads,
# linear and llama3 RoPE scaling, biases, qk-norm.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", dict(seed=5)),
    "mistral-mha-linear-rope": (
        "mistral",
        dict(num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2-tied-bias": ("qwen2", dict(tie_word_embeddings=True, seed=1)),
    "qwen3-mqa-llama3-rope": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=1, seed=2, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
}

_paths: dict[str, str] = {}
_refs: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
_hf: dict[str, HFReference] = {}


BUSY_LENGTHS = [1, 33, 70, 9, 40, 100]


def run_busy_batch(d: Driver, k: int, per_step: bool) -> list[list[int]]:
    """Six requests through plans of `k` steps until all finish: a prompt chunked over two
    plans, one joining a running batch, a preemption while a newcomer takes the blocks, the
    resume (it re-prefills its prompt and what it had produced), and a prompt sharing request
    2's first four blocks (64 cached tokens).  The prompts, in request order."""
    p = random_prompts(BUSY_LENGTHS, 512, seed=7)
    busy_batch_head(d, p, k, per_step)
    shared = p[2][:64] + p[5][:36]
    d.add(5, shared, shared=d.reqs[2].blocks[:4], cached=64)
    run_to_finish(d, k, per_step)
    return [*p[:5], shared]


def busy_batch_head(d: Driver, p: list[list[int]], k: int, per_step: bool) -> None:
    """Requests 0-4 of the busy batch (prompts `p`): a prompt chunked over two plans, one
    joining a running batch, a preemption while a newcomer takes the blocks, the resume."""
    d.add(0, p[0])
    d.add(1, p[1])
    d.add(2, p[2], chunk=40)  # the rest of its prompt in the next plan
    d.run(k, per_step)
    d.prefill(2, len(p[2]) - 1 - 40)
    d.add(3, p[3])  # joins a running batch
    d.run(k, per_step)
    d.preempt(1)  # its blocks (a hybrid model's: its state slot too) go to request 4 first
    d.add(4, p[4])
    d.run(k, per_step)
    d.resume(1)


def run_to_finish(d: Driver, k: int, per_step: bool) -> None:
    """Plans of `k` steps until every request finished (at most 100)."""
    for _ in range(100):
        if all(t.finish for t in d.reqs.values()):
            break
        d.run(k, per_step)


def checkpoint(root: Path, name: str) -> str:
    if name not in _paths:
        arch, kwargs = CONFIGS[name]
        _paths[name] = make_tiny_checkpoint(root, arch, tokenizer=False, **kwargs)
    return _paths[name]


def hf_greedy(path: str, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """HF generate's greedy continuation; it stops at EOS like a request with EOS as stop id."""
    key = (path, tuple(prompt), n)
    if key not in _refs:
        if path not in _hf:
            _hf[path] = HFReference(path)
        _refs[key] = _hf[path].greedy(prompt, n)
    return _refs[key]


def make_runner(path: str, **kw: Any) -> ModelRunner:
    kw.setdefault("num_kv_blocks", 400)
    return ModelRunner(WorkerConfig(path, device="cpu", dtype="float32", block_size=16, **kw))


def sampled(seed: int, **kw: Any) -> SamplingParams:
    base: dict[str, Any] = dict(temperature=0.9, top_p=0.9, top_k=50, seed=seed,
                                max_new_tokens=NEW_TOKENS)
    base.update(kw)
    return SamplingParams(**base)
