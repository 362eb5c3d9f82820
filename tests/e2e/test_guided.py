"""Guided decoding end to end, over one real server (K=8, async postprocessing: the defaults)
on the tiny default model (SentencePiece, 32000 tokens):

* greedy `regex` and `choice` streams and batched Generate calls, concurrent with unguided
  streams, equal HF generate() masked by an outlines-core Guide on the same checkpoint
  (float32); the K=1 sync half is the runner-level test_guided_compiled.py, which spares a
  second server;
* seeded sampled regex outputs fullmatch; json_schema outputs validate; format=JSON outputs
  parse as one JSON object when complete; grammar outputs parse with the grammar;
* the same over HTTP with the official openai client (response_format json_schema and
  json_object, guided_regex);
* min_new_tokens longer than the constraint allows: EOS at the constraint's end;
* requests carry only their constraint's id: a table the gpu worker dropped (more new
  constraints than it keeps) is asked for again, and the output is the same.

The server compiles format=JSON in the background at start (`--guided-precompile-json`,
about 10 s of the compile worker), so its one compile overlaps the first test's HF
references.  Into a guided cache of this module's own, not the session's shared one:
tests/e2e/test_failures.py needs a compile of format=JSON that takes seconds, which a table
left on the shared disk cache would turn into an instant hit, whatever order the modules run.
"""
from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import torch

from tandem_serve.harness.guided_tables import choice_regex
from tandem_serve.harness.metrics_scrape import Scrape
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running
from tests.gpu_worker.guided_utils import hf_guided
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
EOS = 2
N = 40  # max new tokens of a constrained request: every bounded constraint here fits
PROMPTS = ["Once upon a time", "The quick brown fox jumps over", "1, 2, 3, 4,",
           "My phone number is"]
NUM = r"[0-9]{1,4}-[a-z]{2,6}"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe", "the quick fox"]
# outlines-core enforces maxLength (not minimum/maximum): without it a random model's string
# never closes.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}
LONG = 100  # format=JSON: strings are unbounded, so a completed object needs more room
# Sums of one- or two-digit numbers with parentheses: context-free, not a table.
GRAMMAR = """root ::= expr
expr ::= term ("+" term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    yield from running(str(tiny_model_dir), "--served-model-name", MODEL,
                       "--guided-precompile-json", "--guided-cache-dir",
                       str(tmp_path_factory.mktemp("guided-cache")), http=True)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # tiny forwards beside a server on a shared machine
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def reference(path: pathlib.Path, hf: Any, regex: str, text: str, min_new: int = 0
              ) -> tuple[str, int]:
    """HF greedy generate() under the regex: (its text, its token count with the EOS)."""
    out = hf_guided(str(path), regex, hf(text).input_ids, N, min_new)
    assert out[-1] == EOS, "the constraint completes within N tokens"
    return hf.decode(out, skip_special_tokens=True), len(out)


def stream(server: Server, text: str, opts: GenerateOptions) -> pb.GenerationResponse:
    """The streamed text joined, with the last message's count and stop reason."""
    parts, last = [], None
    for r in server.client.stream(text, opts, timeout=120):
        parts.append(r.text)
        last = r
    assert last is not None
    return pb.GenerationResponse(text="".join(parts), stop_reason=last.stop_reason,
                                 generated_token_count=last.generated_token_count)


def guided(**kw: Any) -> GenerateOptions:
    return GenerateOptions(max_new_tokens=N, **kw)


def sampled(seed: int, **kw: Any) -> GenerateOptions:
    kw.setdefault("max_new_tokens", N)
    return GenerateOptions(sample=True, temperature=1.0, seed=seed, **kw)


def test_greedy_regex_and_choice_equal_hf_beside_unguided_streams(
        server: Server, hf: Any, tiny_model_dir: pathlib.Path) -> None:
    constraints = {"regex": (NUM, guided(regex=NUM)),
                   "choice": (choice_regex(CHOICES), guided(choices=CHOICES))}
    want = {(kind, text): reference(tiny_model_dir, hf, regex, text)
            for kind, (regex, _) in constraints.items() for text in PROMPTS}
    assert len({want["choice", t][0] for t in PROMPTS}) > 1, "prompts pick different choices"
    plain = dict(zip(PROMPTS, hf_greedy(tiny_model_dir, [(t, 12) for t in PROMPTS]),
                     strict=True))
    exactly12 = GenerateOptions(max_new_tokens=12, min_new_tokens=12)
    with ThreadPoolExecutor(24) as pool:
        streams = {(kind, t): pool.submit(stream, server, t, opts)
                   for kind, (_, opts) in constraints.items() for t in PROMPTS}
        unguided = {t: pool.submit(stream, server, t, exactly12) for t in PROMPTS}
        batches = {kind: pool.submit(server.client.generate, PROMPTS, opts, 120)
                   for kind, (_, opts) in constraints.items()}
        for (kind, text), future in streams.items():
            r = future.result()
            assert (r.text, r.generated_token_count) == want[kind, text], (kind, text)
            assert r.stop_reason == pb.EOS_TOKEN
        for kind, future in batches.items():
            for text, r in zip(PROMPTS, future.result(), strict=True):
                assert (r.text, r.generated_token_count) == want[kind, text], (kind, text)
                assert r.stop_reason == pb.EOS_TOKEN
        for text, future in unguided.items():
            assert future.result().text == plain[text], text


def test_min_new_tokens_never_forces_a_forbidden_token(server: Server, hf: Any,
                                                       tiny_model_dir: pathlib.Path) -> None:
    """A constraint complete before min_new_tokens ends with EOS there, as in HF with the
    same rule (EOS held back only while the guide allows something else)."""
    for regex, opts in ((choice_regex(CHOICES), guided(choices=CHOICES, min_new_tokens=30)),
                        (NUM, guided(regex=NUM, min_new_tokens=30))):
        for text in PROMPTS[:2]:
            r = stream(server, text, opts)
            assert (r.text, r.generated_token_count) == reference(tiny_model_dir, hf, regex,
                                                                  text, min_new=30)
            assert r.stop_reason == pb.EOS_TOKEN and r.generated_token_count < 30


def test_seeded_samples_fullmatch_and_schemas_validate(server: Server) -> None:
    seeds = range(1, 7)
    with ThreadPoolExecutor(16) as pool:
        regex = {(rx, s): pool.submit(stream, server, PROMPTS[s % 4], sampled(s, regex=rx))
                 for rx in (NUM, PHONE) for s in seeds}
        greedy = [pool.submit(stream, server, t, guided(json_schema=json.dumps(SCHEMA)))
                  for t in PROMPTS]
        samples = [pool.submit(stream, server, PROMPTS[s % 4],
                               sampled(s, json_schema=json.dumps(SCHEMA))) for s in seeds]
        for (rx, s), future in regex.items():
            r = future.result()
            assert r.stop_reason == pb.EOS_TOKEN and re.fullmatch(rx, r.text), (s, r.text)
            if s <= 2:  # alone now, in a busy batch before
                again = stream(server, PROMPTS[s % 4], sampled(s, regex=rx))
                assert again.text == r.text, "a seed draws the same tokens whatever runs beside"
        assert len({regex[NUM, s].result().text for s in seeds}) > 2, "sampling varies"
        objects = [f.result() for f in greedy]
        # Greedy objects all complete; a sampled integer may run past N tokens.
        assert all(r.stop_reason == pb.EOS_TOKEN for r in objects), objects
        objects += [r for r in (f.result() for f in samples) if r.stop_reason == pb.EOS_TOKEN]
    for r in objects:
        jsonschema.validate(json.loads(r.text), SCHEMA)


def _sum_ok(text: str) -> bool:
    """Whether `text` is a sentence of GRAMMAR (recursive descent)."""
    def expr(i: int) -> int:
        i = term(i)
        while i < len(text) and text[i] == "+":
            i = term(i + 1)
        return i

    def term(i: int) -> int:
        if i < len(text) and text[i] == "(":
            i = expr(i + 1)
            if i >= len(text) or text[i] != ")":
                raise ValueError(i)
            return i + 1
        m = re.match(r"[1-9][0-9]?", text[i:])
        if m is None:
            raise ValueError(i)
        return i + m.end()

    try:
        return expr(0) == len(text)
    except ValueError:
        return False


def test_grammar_and_any_json_object(server: Server) -> None:
    """Grammar outputs that ended with EOS are sentences of the grammar; format=JSON outputs
    that ended with EOS parse as one object (the server's start-up compile serves them)."""
    assert _sum_ok("(1+23)+4") and not _sum_ok("(1+2") and not _sum_ok("1+023")
    jobs = [("grammar", t, guided(grammar=GRAMMAR)) for t in PROMPTS[:2]]
    jobs += [("grammar", PROMPTS[s % 2], sampled(s, grammar=GRAMMAR)) for s in range(1, 9)]
    jobs += [("json", t, GenerateOptions(max_new_tokens=LONG, response_format="json"))
             for t in PROMPTS]
    jobs += [("json", PROMPTS[s % 4], sampled(s, response_format="json", max_new_tokens=LONG))
             for s in range(1, 5)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [(kind, pool.submit(stream, server, t, opts)) for kind, t, opts in jobs]
        results = [(kind, f.result()) for kind, f in futures]
    grammar = [r.text for kind, r in results if kind == "grammar" and r.stop_reason ==
               pb.EOS_TOKEN]
    assert len(grammar) > 2 and all(_sum_ok(text) for text in grammar), grammar
    assert any("(" in text for text in grammar), "the grammar's recursion is exercised"
    objects = [json.loads(r.text) for kind, r in results if kind == "json" and r.stop_reason ==
               pb.EOS_TOKEN]
    assert all(isinstance(o, dict) for o in objects), objects
    assert any(objects), "one completed object has members (a random model's strings rarely " \
                         "close: seed 3 makes one within 100 tokens)"


def test_a_table_the_worker_dropped_is_sent_again_with_the_same_output(
        server: Server, hf: Any, tiny_model_dir: pathlib.Path) -> None:
    """Requests carry only their constraint's id.  After more new constraints than the gpu
    worker keeps unused (32), the first one's table is gone from the worker and from the
    scheduler (its last request ended): a new request naming it has the scheduler ask the
    frontend for it again, and decodes exactly as before."""
    clock, text = r"[0-9]{2}:[0-9]{2}", PROMPTS[1]
    url = f"http://127.0.0.1:{server.http_port}/metrics"
    want = reference(tiny_model_dir, hf, clock, text)
    first = stream(server, text, guided(regex=clock))
    assert (first.text, first.generated_token_count) == want
    for i in range(40):  # one at a time: each falls unused before the next one starts
        r = stream(server, text, guided(choices=[str(1000 + i), str(2000 + i)]))
        assert r.text in (str(1000 + i), str(2000 + i)), r.text
    asked = Scrape(url).total("tandem_guided_tables_sent_total", why="asked")
    again = stream(server, text, guided(regex=clock))
    assert (again.text, again.generated_token_count) == want
    assert Scrape(url).total("tandem_guided_tables_sent_total", why="asked") == asked + 1


# ------------------------------------------------------------------ HTTP, the openai client


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                         max_retries=0, timeout=120)


def test_openai_response_formats_and_guided_regex(server: Server, client: openai.OpenAI,
                                                  hf: Any, tiny_model_dir: pathlib.Path) -> None:
    args: dict[str, Any] = dict(model=MODEL, max_tokens=60, temperature=0)
    schema = client.completions.create(prompt=PROMPTS[0], extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, **args)
    assert schema.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)
    # json_object: the same constraint and draws as gRPC's format=JSON with the same seed.
    text = PROMPTS[3]
    r = client.completions.create(prompt=text, model=MODEL, max_tokens=LONG, temperature=1.0,
                                  seed=3, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].text) and isinstance(json.loads(r.choices[0].text), dict)
    grpc_text = stream(server, text, sampled(3, response_format="json", max_new_tokens=LONG))
    assert r.choices[0].text == grpc_text.text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "What is JSON?"}],
                                          response_format={"type": "json_object"}, **args)
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    for text in PROMPTS[:2]:
        r = client.completions.create(prompt=text, extra_body={"guided_regex": PHONE}, **args)
        assert re.fullmatch(PHONE, r.choices[0].text), r.choices[0].text
        assert r.choices[0].text == reference(tiny_model_dir, hf, PHONE, text)[0]
        assert r.choices[0].finish_reason == "stop"
