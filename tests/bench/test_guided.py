"""`bench.serve.guided_load`: which requests are guided, with what, and how the result
reports them."""
from __future__ import annotations

import pytest

from tandem_serve.bench.serve import guided_load as bg
from tandem_serve.bench.serve.backends.base import BackendOptions
from tandem_serve.bench.serve.backends.tandem import TandemBackend
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.metrics import RequestRecord
from tandem_serve.guided.compile import Compiler
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import sentencepiece_dir

ITEMS = [BenchItem(i, f"prompt {i}", 3, 16) for i in range(20)]


def test_a_seeded_share_is_guided_with_a_hint() -> None:
    items = bg.apply(ITEMS, "regex", 0.25, seed=1)
    guided = [it for it in items if it.guided]
    assert len(guided) == 5
    again = bg.apply(ITEMS, "regex", 0.25, seed=1)
    assert [it.index for it in again if it.guided] == [it.index for it in guided]  # seeded
    assert all(it.prompt.startswith("Phone number: ") for it in guided)
    assert bg.apply(ITEMS, "", 0.5, 1) == ITEMS
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        bg.apply(ITEMS, "regex", 1.5, 1)


def test_each_run_compiles_cold_but_means_the_same() -> None:
    a, b = bg.constraint("regex", "t1"), bg.constraint("regex", "t2")
    assert a != b and a["regex"].startswith(bg.PHONE)
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    c = Compiler(tok, tok.vocab_size)
    tables = [c.compile_table(GuidedSpec(SpecKind.REGEX, r["regex"]), "k") for r in (a, b)]
    assert (tables[0].next_state == tables[1].next_state).all()
    for kind, spec_kind in (("json", SpecKind.JSON_SCHEMA), ("grammar", SpecKind.GRAMMAR)):
        text = next(iter(bg.constraint(kind, "t3").values()))
        c.compile(GuidedSpec(spec_kind, text), "k")  # the bench's constraints compile
    c.compile(GuidedSpec(SpecKind.CHOICE, choices=tuple(bg.constraint("choice", "")["choices"])),
              "k")


def test_the_backend_sends_the_constraint_without_min_tokens() -> None:
    item = bg.apply(ITEMS[:1], "choice", 1.0, 0)[0]
    req = TandemBackend(BackendOptions()).request(item)
    assert list(req.params.decoding.choice.choices) == bg.COLOURS
    assert req.params.stopping.min_new_tokens == 0 and req.params.stopping.max_new_tokens == 16
    plain = TandemBackend(BackendOptions()).request(ITEMS[0])
    assert plain.params.stopping.min_new_tokens == 16


def test_summary_reports_the_first_request_apart() -> None:
    items = bg.apply(ITEMS[:4], "json", 0.5, 0)
    records = []
    for i, it in enumerate(items):
        r = RequestRecord(send_time=float(i), success=True, output_tokens=5,
                          generated_text="{}" if it.guided else "x")
        r.add_chunk(i + (2.0 if it.guided and not any(x.guided for x in items[:i]) else 0.1),
                    5)
        r.end_time = i + 3.0
        records.append(r)
    s = bg.summary(items, records, "json", 0.5)
    assert s["guided_requests"] == 2 and s["guided_failed"] == 0
    assert s["guided_first_ttft_ms"] == pytest.approx(2000)
    assert s["guided_median_ttft_ms"] == pytest.approx(100)
    assert s["unguided_median_ttft_ms"] == pytest.approx(100)
    text = bg.format_summary(s)
    assert "First guided TTFT, cold compile (ms):" in text and "2000.00" in text


def test_bench_guided_names_an_unknown_kind() -> None:
    import argparse

    from tandem_serve.bench.guided import main as guided_serve

    p = argparse.ArgumentParser()
    guided_serve.add_arguments(p)
    with pytest.raises(SystemExit, match="--kinds: unknown 'regexp'"):
        guided_serve.main(p.parse_args(["--kinds", "regex,regexp"]))


def test_bench_guided_refuses_a_run_with_failed_guided_requests() -> None:
    from tandem_serve.bench.guided.main import check

    check("regex", {"completed": 8, "guided_failed": 0}, 8)
    with pytest.raises(SystemExit, match="regex: 1 requests failed: .*bad regex"):
        check("regex", {"completed": 7, "guided_failed": 1, "errors": [],
                        "guided_first_error": "INVALID_ARGUMENT: bad regex"}, 8)
