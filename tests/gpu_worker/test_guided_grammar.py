"""Grammar rows (llguidance matchers on the worker's host, a bitmask per step), through
ModelRunner.execute (`Driver`).

A grammar that is a regex must give exactly what the device table of that regex gives (and
so HF masked by outlines-core): two libraries, two paths, one answer.  Context-free grammars
are checked by accepting the output with a fresh matcher and, for JSON, by parsing it.
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from tandem_serve.proto.guided_messages import GuidedGrammar
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.gpu_worker.guided_utils import (
    grammar,
    guided,
    guided_checkpoint,
    hf_guided,
    table,
    text,
)
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import Driver, hf_greedy, make_runner
from tests.gpu_worker.sync_guard import forbid_host_sync

NUM = "[0-9]{1,4}-[a-z]{2,5}"
# Brackets nested at least twice, matched by kind around one to three letters.
LISTS = ('start: "(" inner ")"\ninner: "[" expr "]"\n'
         'expr: "(" expr ")" | "[" expr "]" | /[a-z]{1,3}/')
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
JSON = "start: %json " + json.dumps(
    {**SCHEMA, "x-guidance": {"whitespace_flexible": False}})


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return guided_checkpoint(tmp_path_factory.mktemp("grammar-ckpt"))


def _accepted(path: str, lark: str, out: list[int]) -> bool:
    """A fresh matcher takes the whole output (a complete one ends in EOS)."""
    tok = Tokenizer.from_dir(path)
    lltok = llguidance.LLTokenizer(tok.raw.to_str(), n_vocab=512, eos_token=[EOS_ID])
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    body = out[:-1] if out[-1] == EOS_ID else out
    ok = bool(m.consume_tokens(body)) and not m.is_error()
    return ok and (out[-1] != EOS_ID or m.is_accepting())


def _nested(s: str) -> bool:
    """LISTS's language, checked without llguidance."""
    depth = len(s) - len(s.lstrip("(["))
    core, opens, closes = s[depth: len(s) - depth], s[:depth], s[len(s) - depth:]
    pairs = {"(": ")", "[": "]"}
    return (depth >= 2 and opens[:2] == "([" and 1 <= len(core) <= 3 and core.isalpha()
            and closes == "".join(pairs[c] for c in reversed(opens)))


def _driver(path: str, seed: int, constraints: list[Any]) -> Driver:
    d = Driver(make_runner(path), seed=seed)
    for c in constraints:
        d.send_table(c)
    return d


@pytest.mark.parametrize("k", [1, 8])
def test_a_regex_grammar_decodes_like_its_device_table(path: str, k: int) -> None:
    g, t = grammar(f"start: /{NUM}/"), table(path, NUM)
    d = _driver(path, k, [g, t])
    p = random_prompts([11, 23, 35, 16, 27], 512, seed=20 + k)
    d.add(0, p[0], guided(g, 30))
    d.add(1, p[0], guided(t, 30))
    d.add(2, p[1])
    d.run(k)
    d.add(3, p[2], guided(g, 30))  # joins the running batch
    d.add(4, p[3], guided(g, 30, temperature=0.9, top_k=30, seed=4))
    d.run_until_done([k])
    assert d.reqs[0].out == d.reqs[1].out == hf_guided(path, NUM, p[0], 30)
    assert d.reqs[3].out == hf_guided(path, NUM, p[2], 30)
    assert d.reqs[2].out == hf_greedy(path, p[1])
    for rid in (0, 3, 4):
        assert d.reqs[rid].finish == FinishReason.EOS_TOKEN
        assert _accepted(path, f"start: /{NUM}/", d.reqs[rid].out)


def test_context_free_grammars_accept_their_outputs(path: str) -> None:
    lists, obj = grammar(LISTS), grammar(JSON)
    d = _driver(path, 3, [lists, obj])
    prompts = random_prompts([7 + 6 * i for i in range(8)], 512, seed=30)
    for rid, prompt in enumerate(prompts):
        sampling: dict[str, Any] = {} if rid < 4 else dict(temperature=0.8, seed=rid, top_p=0.9)
        d.add(rid, prompt, guided(lists if rid % 2 else obj, 48, **sampling))
    d.run_until_done([8, 1])
    for rid in range(8):
        out = d.reqs[rid].out
        assert _accepted(path, LISTS if rid % 2 else JSON, out), text(path, out)
        if d.reqs[rid].finish != FinishReason.EOS_TOKEN:
            continue
        if rid % 2:
            assert _nested(text(path, out)), text(path, out)
        else:
            jsonschema.validate(json.loads(text(path, out)), SCHEMA)
    finished = [rid for rid in range(8) if d.reqs[rid].finish == FinishReason.EOS_TOKEN]
    assert len(finished) >= 6, "most outputs complete their grammar within 48 tokens"


def test_preempted_grammar_rows_replay_their_matchers(path: str) -> None:
    lists = grammar(LISTS)
    a, b = random_prompts([30, 45], 512, seed=40)

    def run(preempt: bool) -> list[int]:
        d = _driver(path, 5, [lists])
        d.add(0, a, guided(lists, 40, temperature=0.7, seed=9))
        d.add(1, b)
        d.run(4)
        if preempt:
            d.preempt(0)
            d.drop_table(lists.grammar_id)  # the worker may forget it meanwhile
            d.run(4)
            assert d.runner.requests[0].matcher is None
            d.send_table(lists)
            d.resume(0)
        d.run_until_done([8, 4])
        return d.reqs[0].out

    kept = run(preempt=True)
    assert kept == run(preempt=False)
    assert _accepted(path, LISTS, kept)


def test_min_new_tokens_lets_a_complete_grammar_end(path: str) -> None:
    g = grammar('start: "yes" | "no"')
    d = _driver(path, 7, [g])
    [prompt] = random_prompts([19], 512, seed=50)
    d.add(0, prompt, guided(g, 20, min_new_tokens=10))
    d.run_until_done([8])
    out = d.reqs[0].out
    assert d.reqs[0].finish == FinishReason.EOS_TOKEN and len(out) < 10
    assert text(path, out) in ("yes", "no")


def test_grammar_plans_run_under_the_sync_guard(path: str) -> None:
    """The loop itself reads nothing: step k's tokens reach the matchers through the helper
    thread (the one host wait of a grammar plan, documented in gpu_worker/constrain/grammar.py)."""
    g, t = grammar(LISTS), table(path, NUM)
    d = _driver(path, 9, [g, t])
    d.runner.step_guard = forbid_host_sync
    p = random_prompts([14, 28], 512, seed=60)
    d.add(0, p[0], guided(g, 30))
    d.add(1, p[1], guided(t, 30))
    d.run_until_done([8])
    assert _accepted(path, LISTS, d.reqs[0].out)
    assert d.reqs[1].out == hf_guided(path, NUM, p[1], 30)


def test_an_invalid_grammar_ends_its_rows_not_the_worker(path: str) -> None:
    bad = GuidedGrammar("bad", "start: missing_rule")
    d = _driver(path, 11, [bad])
    p = random_prompts([10, 12], 512, seed=70)
    d.add(0, p[0], guided(bad, 20))
    d.add(1, p[1])
    d.run_until_done([8])
    assert d.reqs[0].out == [EOS_ID] and d.reqs[0].finish == FinishReason.EOS_TOKEN
    assert d.reqs[1].out == hf_greedy(path, p[1])
