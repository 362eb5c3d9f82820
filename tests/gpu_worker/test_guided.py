"""Guided decoding with device tables, through ModelRunner.execute (`Driver`), against HF
generate() masked by an outlines-core Guide (float32, greedy).

Regex, choice and JSON-schema tables share batches with unguided rows, for K=1 and K=8,
across preemption (the state is replayed from the kept output, and the table may be dropped
and resent meanwhile), with seeds, with min_new_tokens, and under the host-sync guard.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from tandem_serve.gpu_worker.constrain import tables as device_guided
from tandem_serve.gpu_worker.constrain.tables import GuidedBatch
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.harness.guided_tables import choice_regex, json_schema_regex
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import TokenBatch
from tests.gpu_worker.guided_utils import (
    VOCAB,
    grammar,
    guided,
    guided_checkpoint,
    hf_guided,
    hf_logprobs,
    table,
    text,
)
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import Driver, hf_greedy, make_runner, sampled
from tests.gpu_worker.sync_guard import HostSyncError, forbid_host_sync

NUM = "[0-9]{1,4}-[a-z]{2,5}"
CHOICE = choice_regex(["yes", "no", "maybe", "the quick fox"])
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
JSON = json_schema_regex(SCHEMA)
WORDS = "[a-z ]{3,30}"
DIGITS = "[0-9 ]{2,300}"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return guided_checkpoint(tmp_path_factory.mktemp("guided-ckpt"))


def _driver(path: str, seed: int, regexes: list[str], **kw: Any) -> tuple[Driver, list[Any]]:
    d = Driver(make_runner(path, **kw), seed=seed)
    tables = [table(path, rx) for rx in regexes]
    for t in tables:
        d.send_table(t)
    return d, tables


def _check_matches(path: str, out: list[int], regex: str) -> None:
    assert out[-1] == EOS_ID, "a finished constraint ends with EOS"
    assert re.fullmatch(regex, text(path, out)), text(path, out)


# ---------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_guided_rows_match_hf_in_a_mixed_batch(path: str, k: int) -> None:
    regexes = [NUM, CHOICE, JSON, WORDS]
    d, tables = _driver(path, k, regexes)
    p = random_prompts([9, 30, 17, 44, 12, 25, 38], 512, seed=10 + k)
    plan = {0: 0, 2: 1, 3: 2, 5: 0, 6: 3}  # row -> regex; rows 1 and 4 unguided
    for rid in (0, 1, 2, 3):
        d.add(rid, p[rid], guided(tables[plan[rid]], 40) if rid in plan else None)
    d.run(k)
    for rid in (4, 5, 6):  # join a running batch; 5 shares row 0's table
        d.add(rid, p[rid], guided(tables[plan[rid]], 40) if rid in plan else None)
    d.run_until_done([k])
    outputs = set()
    for rid, i in plan.items():
        out = d.reqs[rid].out
        assert out == hf_guided(path, regexes[i], p[rid], 40), f"request {rid}"
        _check_matches(path, out, regexes[i])
        assert d.reqs[rid].finish == FinishReason.EOS_TOKEN
        outputs.add(text(path, out))
    assert len(outputs) == len(plan), "different prompts give different constrained outputs"
    for rid in (1, 4):
        assert d.reqs[rid].out == hf_greedy(path, p[rid]), f"unguided request {rid}"
    json.loads(text(path, d.reqs[3].out))  # the JSON schema's output parses


def test_host_state_after_a_plan_is_the_replayed_output(path: str) -> None:
    """_collect's state read-back agrees with replaying the tokens through the table."""
    d, (t,) = _driver(path, 3, [JSON])
    [prompt] = random_prompts([20], 512, seed=4)
    d.add(0, prompt, guided(t, 40))
    registry = d.runner.guided
    for _ in range(3):
        d.run(4)
        req = d.runner.requests[0]
        out = req.history[req.num_prompt:]
        assert len(out) > 0 and req.guided_state == registry.table(t.table_id).replay(out)


# ---------------------------------------------------------------------------- preemption


def test_preempted_guided_rows_resume_their_state(path: str) -> None:
    d, (t_json,) = _driver(path, 5, [JSON])
    a, b, c = random_prompts([40, 21, 60], 512, seed=6)
    d.add(0, a, guided(t_json, 40))
    d.add(1, b, guided(t_json, 40))
    d.run(4)
    d.run(4)
    assert not d.reqs[0].finish and not d.reqs[1].finish
    d.preempt(0)
    d.preempt(1)
    d.drop_table(t_json.table_id)  # no running request uses it: the worker may forget it
    d.add(2, c)  # reuses the freed blocks
    d.run(4)
    assert t_json.table_id not in d.runner.guided.tables
    assert d.runner.requests[0].guided_state == -1  # forgotten while preempted
    d.send_table(t_json)  # resent with the resume
    d.resume(0, chunk=30)  # re-prefill in two chunks, then replay the state
    d.resume(1)
    d.run(8)
    d.prefill(0, len(d.reqs[0].history) - 1 - 30)
    d.run_until_done([8, 1])
    assert d.reqs[0].out == hf_guided(path, JSON, a, 40)
    assert d.reqs[1].out == hf_guided(path, JSON, b, 40)
    assert d.reqs[2].out == hf_greedy(path, c)


def test_guided_rows_with_a_cached_prefix_and_sync_publishing(path: str) -> None:
    d, (t,) = _driver(path, 21, [JSON])
    base, tail = random_prompts([80, 21], 512, seed=22)
    d.add(0, base, guided(t, 40))
    d.run(4, per_step=False)
    prompt = base[:64] + tail
    d.add(1, prompt, guided(t, 40), shared=d.reqs[0].blocks[:4], cached=64)
    d.run(8, per_step=False)  # sync mode: the plan's tokens go out after its last step
    d.run_until_done([8])
    assert d.reqs[0].out == hf_guided(path, JSON, base, 40)
    assert d.reqs[1].out == hf_guided(path, JSON, prompt, 40)


def test_a_table_the_worker_does_not_hold_is_an_error(path: str) -> None:
    d, _ = _driver(path, 1, [])
    t = table(path, NUM)
    d.add(0, random_prompts([8], 512)[0], guided(t))
    with pytest.raises(KeyError, match="not at the worker"):
        d.run(1)


# ---------------------------------------------------------------------------- sampling


def test_seeded_guided_rows_fullmatch_and_ignore_the_batch(path: str) -> None:
    d, tables = _driver(path, 7, [NUM, JSON, WORDS])
    prompts = random_prompts([12 + 5 * i for i in range(9)], 512, seed=8)
    for rid in range(9):
        t = tables[rid % 3]
        d.add(rid, prompts[rid], guided(t, 40, temperature=0.9, top_p=0.95, top_k=40,
                                        seed=100 + rid))
    d.add(9, prompts[0], sampled(5))  # unguided, sampled
    d.run_until_done([8, 1])
    for rid in range(9):
        _check_matches(path, d.reqs[rid].out, [NUM, JSON, WORDS][rid % 3])
    jsonschema.validate(json.loads(text(path, d.reqs[1].out)), SCHEMA)
    assert len({text(path, d.reqs[r].out) for r in (0, 3, 6)}) == 3
    # The same seeded request alone: the same tokens.
    alone, (t_num, *_) = _driver(path, 9, [NUM])
    alone.add(3, prompts[3], guided(t_num, 40, temperature=0.9, top_p=0.95, top_k=40,
                                    seed=103))
    alone.run_until_done([4])
    assert alone.reqs[3].out == d.reqs[3].out


# ---------------------------------------------------------------------------- finishing


def test_min_new_tokens_never_forces_what_the_constraint_forbids(path: str) -> None:
    d, (t_choice, t_words) = _driver(path, 11, [CHOICE, DIGITS])
    p = random_prompts([15, 18, 21, 24, 27, 30], 512, seed=12)
    d.add(0, p[0], guided(t_choice, 40, min_new_tokens=20))  # complete long before 20
    d.add(1, p[1], guided(t_words, 40, min_new_tokens=12))  # EOS held back where it can be
    d.add(2, p[2], SamplingParams(max_new_tokens=12, min_new_tokens=12, stop_token_ids=[EOS_ID]))
    d.run_until_done([8])
    out0, out1 = d.reqs[0].out, d.reqs[1].out
    assert out0 == hf_guided(path, CHOICE, p[0], 40, min_new=20)
    assert len(out0) < 20 and d.reqs[0].finish == FinishReason.EOS_TOKEN
    _check_matches(path, out0, CHOICE)
    free = hf_guided(path, DIGITS, p[1], 40)
    assert out1 == hf_guided(path, DIGITS, p[1], 40, min_new=12)
    assert len(free) < 12 <= len(out1) - 1, "min_new_tokens held EOS back"
    _check_matches(path, out1, DIGITS)
    assert len(d.reqs[2].out) == 12


def test_stop_ids_and_max_tokens_still_end_guided_rows(path: str) -> None:
    d, (t_words,) = _driver(path, 13, [WORDS])
    p = random_prompts([18, 18], 512, seed=14)
    ref = hf_guided(path, WORDS, p[0], 40)
    stop = ref[3]
    d.add(0, p[0], guided(t_words, 40, stop_token_ids=[EOS_ID, stop]))
    d.add(1, p[1], guided(t_words, 4))
    d.run_until_done([8])
    assert d.reqs[0].out == ref[: ref.index(stop) + 1]
    assert d.reqs[0].finish == FinishReason.EOS_TOKEN
    assert d.reqs[1].out == hf_guided(path, WORDS, p[1], 40)[:4]
    assert d.reqs[1].finish == FinishReason.MAX_TOKENS


def test_logprobs_report_the_models_distribution(path: str) -> None:
    d, (t,) = _driver(path, 15, [JSON])
    [prompt] = random_prompts([26], 512, seed=16)
    d.add(0, prompt, guided(t, 40, logprobs=True, top_n=2))
    d.run_until_done([8])
    out = d.reqs[0].out
    rows = [(b.logprobs[i], b.ranks[i], b.top_ids[i]) for b in d.messages
            if isinstance(b, TokenBatch) and b.logprobs is not None and b.ranks is not None
            and b.top_ids is not None
            for i in range(len(b.request_ids)) if b.token_ids[i] >= 0]
    assert len(rows) == len(out)
    expected = hf_logprobs(path, prompt, out)
    assert [float(r[0]) for r in rows] == pytest.approx(expected, abs=1e-4)
    # The constraint picked tokens the model did not rank first: ranks say so.
    assert max(int(r[1]) for r in rows) > 1
    assert any(int(r[2][0]) != tok for r, tok in zip(rows, out, strict=True))


# ---------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("k", [1, 8])
def test_k_step_loop_with_guided_rows_never_reads_the_device(path: str, k: int) -> None:
    d, tables = _driver(path, 17, [NUM, CHOICE, JSON])
    d.runner.step_guard = forbid_host_sync
    p = random_prompts([10, 20, 30, 15, 25, 35], 512, seed=18)
    d.add(0, p[0], guided(tables[0], 40))
    d.add(1, p[1], guided(tables[1], 40, temperature=0.8, top_k=20, seed=1))
    d.add(2, p[2], guided(tables[2], 40, min_new_tokens=5, repetition_penalty=1.2,
                          logprobs=True, top_n=3))
    d.add(3, p[3])
    d.add(4, p[4], sampled(4, min_p=0.05))
    d.run(k)
    d.add(5, p[5], guided(tables[0], 40, temperature=0.7, seed=3, min_new_tokens=2))
    d.run_until_done([k])
    assert d.reqs[0].out == hf_guided(path, NUM, p[0], 40)
    assert d.reqs[3].out == hf_greedy(path, p[3])
    for rid, i in ((1, 1), (2, 2), (5, 0)):
        _check_matches(path, d.reqs[rid].out, [NUM, CHOICE, JSON][i])

    # The guided work is inside the guard: a host read there fails the plan.
    prepare = GuidedBatch.prepare

    def reads_host(self: GuidedBatch) -> Any:
        self.state.tolist()
        return prepare(self)

    d.add(6, p[0], guided(tables[0], 40))
    GuidedBatch.prepare = reads_host  # type: ignore[method-assign]
    try:
        with pytest.raises(HostSyncError):
            d.run(k)
    finally:
        GuidedBatch.prepare = prepare  # type: ignore[method-assign]


# ---------------------------------------------------------------------------- CUDA graphs


def _graph_run(path: str, runner: Any) -> dict[int, list[int]]:
    g = grammar(f"start: /{NUM}/")
    d, tables = Driver(runner, seed=19), [table(path, rx) for rx in (NUM, JSON)]
    for c in (*tables, g):
        d.send_table(c)
    p = random_prompts([5, 40, 17, 28], 512, seed=20)
    d.add(0, p[0], guided(tables[0], 40))
    d.add(1, p[1])
    d.add(2, p[2], guided(tables[1], 40, temperature=0.8, seed=2, logprobs=True, top_n=2))
    d.run(4)
    d.add(3, p[3], guided(g, 40, min_new_tokens=3))
    d.run_until_done([8, 1])
    assert d.reqs[0].out == hf_guided(path, NUM, p[0], 40)
    _check_matches(path, d.reqs[2].out, JSON)
    _check_matches(path, d.reqs[3].out, NUM)
    return d.outputs()


def test_guided_rows_on_the_graph_plumbing_on_cpu(path: str) -> None:
    """Replayed 'graphs' (eager on CPU) hand the guided mask the static logits buffer."""
    from tandem_serve.gpu_worker.graphs.decode import DecodeGraphs
    from tests.gpu_worker.test_runner_graphs import EagerReplay

    class CpuGraphs(DecodeGraphs):
        def _record(self, run: Any) -> tuple[EagerReplay, torch.Tensor]:
            replay = EagerReplay(run)
            return replay, replay.out

    runner = make_runner(path, max_model_len=300, max_num_seqs=8)
    runner.graphs = CpuGraphs(runner.executor.forward_decode, 8, -(-300 // 16), 16, runner.device)
    assert _graph_run(path, runner) == _graph_run(path, make_runner(path, max_model_len=300))
    assert runner.graphs._graphs


@pytest.mark.gpu
def test_guided_rows_with_cuda_graphs_match_eager(path: str) -> None:
    def runner(graphs: bool) -> ModelRunner:
        r = ModelRunner(WorkerConfig(path, device="cuda", dtype="float32", block_size=16,
                                     num_kv_blocks=200, max_num_seqs=8, cuda_graphs=graphs))
        # Dispatch checks only: the publisher and grammar threads wait on copy events.
        r.step_guard = functools.partial(forbid_host_sync, cuda_sync_debug=False)
        return r

    graphed = runner(True)
    with_graphs = _graph_run(path, graphed)
    assert graphed.graphs is not None and graphed.graphs.enabled and graphed.graphs._graphs
    assert with_graphs == _graph_run(path, runner(False))


# ---------------------------------------------------------------------------- the mask's two paths


@pytest.mark.parametrize("regex", [CHOICE, NUM, JSON, WORDS])
def test_live_token_mask_equals_the_full_gather(path: str, regex: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables with few live tokens take the dead-row + live-gather path; it must mask exactly
    what the full gather masks, in every state the rows are in."""
    t = table(path, regex)
    masked = {}
    for share in (1, VOCAB + 1):  # every table live-path, then none
        monkeypatch.setattr(device_guided, "LIVE_SHARE", share)
        reg = device_guided.GuidedRegistry(torch.device("cpu"), VOCAB, path)
        reg.apply([t], [])
        assert (reg.table(t.table_id).live is not None) == (share == 1)
        states = list(range(t.next_state.shape[0]))  # every state, DONE included
        reqs = [RequestState(i, [1], 1, guided(t), guided_state=s) for i, s in enumerate(states)]
        batch = device_guided.GuidedBatch(reg, reqs)
        logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(0))
        batch.prepare()
        batch.apply_(logits)
        masked[share] = logits
    assert torch.equal(masked[1], masked[VOCAB + 1])
    assert torch.isinf(masked[1]).any() and torch.isfinite(masked[1]).any()
