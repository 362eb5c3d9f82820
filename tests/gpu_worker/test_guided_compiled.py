"""The K=1 sync half of the guided end-to-end test (tests/e2e/test_guided.py runs K=8 async
over a server): tables from the serving compiler (`guided.compile.Compiler`, what the compile
worker runs) for the tiny default model (SentencePiece, 32000 tokens), through
ModelRunner.execute at K=1 publishing after the plan, beside unguided rows, against HF
generate() masked by an outlines-core Guide built here from the regex (float32, greedy).

A runner test rather than a second server: the server's other halves (frontend, scheduler,
postprocessing) see nothing that depends on K or the publishing mode for a guided row.
"""
from __future__ import annotations

import json
import pathlib

import jsonschema

from tandem_serve.guided.compile import Compiler
from tandem_serve.guided.forms import spec_regex
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto.guided_messages import GuidedTable
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.gpu_worker.guided_utils import guided, hf_guided
from tests.gpu_worker.runner_driver import Driver, hf_greedy, make_runner

PROMPTS = ["Once upon a time", "The quick brown fox jumps over", "1, 2, 3, 4,",
           "My phone number is", "Tandem runs the model while"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
SPECS = [GuidedSpec(SpecKind.REGEX, r"[0-9]{1,4}-[a-z]{2,6}"),
         GuidedSpec(SpecKind.CHOICE, choices=("yes", "no", "maybe", "the quick fox")),
         GuidedSpec(SpecKind.JSON_SCHEMA, json.dumps(SCHEMA))]
# The judge's regex for each: written out for regex and choice; the schema's is outlines-core's
# own (build_regex_from_schema), which the server uses too.
REFERENCE = [SPECS[0].value, "(yes|no|maybe|the quick fox)", spec_regex(SPECS[2])]
N = 40


def test_compiled_tables_at_k1_sync_equal_hf(tiny_model_dir: pathlib.Path) -> None:
    path = str(tiny_model_dir)
    tok = Tokenizer.from_dir(path)
    compiler = Compiler(tok, 32000)
    tables = []
    for i, spec in enumerate(SPECS):
        table, _ = compiler.compile(spec, f"spec-{i}")
        assert isinstance(table, GuidedTable)
        tables.append(table)
    d = Driver(make_runner(path), seed=3)
    for t in tables:
        d.send_table(t)
    prompts = [tok.encode(text) for text in PROMPTS]
    # request -> spec index (None: unguided); 5 and 6 join a running batch.
    rows: dict[int, int | None] = {0: 0, 1: 1, 2: None, 3: 2, 4: 1, 5: 0, 6: None}
    for rid in range(5):
        spec = rows[rid]
        d.add(rid, prompts[rid], guided(tables[spec], N) if spec is not None else None)
    d.run(1, per_step=False)
    d.add(5, prompts[2], guided(tables[0], N, min_new_tokens=30))
    d.add(6, prompts[4])
    while any(not t.finish for t in d.reqs.values()):
        d.run(1, per_step=False)
    for rid, spec in rows.items():
        out = d.reqs[rid].out
        if spec is None:
            assert out == hf_greedy(path, d.reqs[rid].prompt), f"unguided request {rid}"
            continue
        min_new = d.reqs[rid].sampling.min_new_tokens
        assert out == hf_guided(path, REFERENCE[spec], d.reqs[rid].prompt, N, min_new), \
            f"request {rid} ({SPECS[spec].kind.value})"
        assert d.reqs[rid].finish == FinishReason.EOS_TOKEN
    jsonschema.validate(json.loads(tok.decode(d.reqs[3].out[:-1])), SCHEMA)
    assert len(d.reqs[5].out) < 30, "min_new_tokens never forces a forbidden token"
