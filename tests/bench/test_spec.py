"""`tandem bench spec` without servers: its flags, the copier and its copy prompts (checked
against a real forward), the figures it takes from the counters, and its tables."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from tandem_serve.bench.spec import main as spec
from tandem_serve.bench.spec.report import NONE, run_figures, summarise, table, verdicts
from tandem_serve.bench.spec.workload import RESTART, build_items


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_fast_preset_and_flags_on_top() -> None:
    s = spec.settings(parse("--preset", "fast"))
    assert s["batches"] == (1, 32) and s["modes"] == ["async:8", "sync:1"]
    assert s["workloads"] == ["copy", "plain"] and s["repeats"] == 1
    s = spec.settings(parse("--preset", "fast", "--batches", "2,4", "--output-len", "8",
                            "--modes", "sync:1"))
    assert s["batches"] == (2, 4) and s["output_len"] == 8 and s["modes"] == ["sync:1"]
    assert spec.num_prompts(s, 1) == 4 and spec.num_prompts(s, 32) == 32


@pytest.mark.parametrize(("argv", "message"), [
    (("--modes", "async:4"), "--modes: unknown mode 'async:4'"),
    (("--workloads", "copy,prose"), "--workloads: unknown 'prose'"),
    (("--batches", "1,x"), "--batches: expected comma-separated integers"),
    (("--batches", "0"), "--batches: expected integers >= 1"),
    (("--output-len", "-1"), "--output-len: must be >= 1"),
])
def test_bad_flags_are_named(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        spec.settings(parse(*argv))


def test_spec_arms_from_names_and_json() -> None:
    arms = spec.spec_arms([], "")
    assert list(arms) == ["ngram k=4"]
    assert json.loads(arms["ngram k=4"])["prompt_lookup_min"] == 2
    custom = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert list(spec.spec_arms(["ngram", custom], "")) == ["ngram k=4", "ngram k=2"]
    drafted = spec.spec_arms(["draft_model"], "/models/tiny-draft/")
    assert json.loads(drafted["draft_model k=3 (tiny-draft)"])["model"] == "/models/tiny-draft/"
    with pytest.raises(SystemExit, match="draft_model needs --draft-model"):
        spec.spec_arms(["draft_model"], "")
    with pytest.raises(SystemExit, match="neither a name"):
        spec.spec_arms(["{oops"], "")


@pytest.fixture(scope="module")
def copier_dir(tmp_path_factory: pytest.TempPathFactory, fast_model_dir: Path) -> Path:
    """The copier recipe on the fast tiny model (same tokenizer, fewer weights)."""
    from tandem_serve.bench.spec.copier import build_copier

    path = tmp_path_factory.mktemp("copier") / "model"
    shutil.copytree(fast_model_dir, path)
    build_copier(path)
    return path


def test_the_copier_continues_a_copy_prompt_by_copying(copier_dir: Path) -> None:
    """A real forward of the copier (transformers) over a copy prompt and the passage's
    next tokens: every greedy prediction after the restart is the passage's next token."""
    import torch
    from transformers import LlamaForCausalLM

    from tandem_serve.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(str(copier_dir))
    item = build_items("copy", str(copier_dir), True, tok, 2, 40, 24, seed=3)[1]
    ids = tok.encode(item.prompt)
    passage = ids[1:-RESTART]
    assert ids[-RESTART:] == passage[:RESTART] and len(passage) == 40
    model = LlamaForCausalLM.from_pretrained(str(copier_dir)).eval()
    full = ids + passage[RESTART:RESTART + 24]
    with torch.no_grad():
        pred = model(torch.tensor([full])).logits[0].argmax(-1).tolist()
    after = pred[len(ids) - 1:len(ids) - 1 + 24]
    assert after == passage[RESTART:RESTART + 24]
    # Its text is whole words: what a text-only client sends re-encodes to the same ids.
    assert item.prompt_len == len(ids) and all(w.isalpha() for w in item.prompt.split())


def test_copy_prompts_refuse_an_output_longer_than_the_passage(copier_dir: Path) -> None:
    from tandem_serve.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(str(copier_dir))
    with pytest.raises(ValueError, match="--output-len \\(40\\) must be at most --input-len"):
        build_items("copy", str(copier_dir), True, tok, 1, 40, 40, seed=0)


def test_natural_and_plain_prompts(copier_dir: Path) -> None:
    from tandem_serve.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(str(copier_dir))
    natural = build_items("copy", str(copier_dir), False, tok, 3, 64, 16, seed=0)
    assert all("Copy the following passage" in i.prompt and i.output_len == 16
               for i in natural)
    plain = build_items("plain", str(copier_dir), True, tok, 3, 64, 16, seed=0)
    assert len(plain) == 3 and all(abs(i.prompt_len - 64) <= 2 for i in plain)


def test_run_figures_from_counter_deltas() -> None:
    result = {"completed": 4, "total_output_tokens": 4 * 33, "median_tpot_ms": 2.0,
              "p99_tpot_ms": 3.0, "output_throughput": 100.0}
    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 30.0}
    after = {"drafts": 30.0, "draft_tokens": 120.0, "accepted": 126.0}
    fig = run_figures(result, before, after)
    assert fig["acceptance"] == pytest.approx(96 / 80)
    # 132 output tokens, 96 of them accepted drafts: 36 rows emitted them.
    assert fig["tokens_per_forward"] == pytest.approx(132 / 36)
    none = run_figures(result, before, before)
    assert none["acceptance"] is None and none["tokens_per_forward"] == pytest.approx(1.0)


def fig(tpot: float, tput: float, acceptance: float | None = None) -> dict:
    return {"median_tpot_ms": tpot, "p99_tpot_ms": tpot * 2, "output_throughput": tput,
            "acceptance": acceptance, "tokens_per_forward": 1.0, "drafts": 0.0,
            "draft_tokens": 0.0, "accepted": 0.0}


def test_ratios_are_paired_within_a_repeat_and_judged() -> None:
    runs = {"async K=8 | copy | 1": {"ngram k=4": [fig(2.0, 200, 0.9), fig(6.0, 60, 0.9)],
                                     NONE: [fig(4.0, 100), fig(10.0, 40)]},
            "async K=8 | plain | 32": {NONE: [fig(10.0, 100)], "ngram k=4": [fig(11.0, 90)]}}
    rows = summarise(runs, [NONE, "ngram k=4"])
    assert [r["arm"] for r in rows] == [NONE, "ngram k=4", NONE, "ngram k=4"]
    copy = rows[1]
    # per repeat 0.5 and 0.6: their median, not the ratio of the medians (4 / 7)
    assert copy["median_tpot_ms_ratio"] == pytest.approx(0.55)
    assert copy["output_throughput_ratio"] == pytest.approx(1.75)
    text = table(rows)
    assert "| async K=8 | copy | 1 | ngram k=4 | 90% | 1.00 | 4.00 | 8.00 | 130 | 0.55× | " \
           "0.55× | 1.75× |" in text
    assert "| async K=8 | plain | 32 | no spec | – |" in text
    assert verdicts(rows) == [
        "async K=8, copy prompts at batch 1, ngram k=4: TPOT p50 0.55× no speculation "
        "(target ≤ 0.6×: met)",
        "async K=8, plain prompts at batch 32, ngram k=4: TPOT p50 1.10× no speculation "
        "(target ≤ 1.05×: not met)"]


def test_the_gpu_check_arms_are_the_methods_the_tree_serves() -> None:
    from tandem_serve.bench.gpu_check.checks.spec import SPEC_ARMS, spec_arms
    from tandem_serve.proto.speculative import METHODS

    served, missing = spec_arms()
    assert "ngram" in served and set(served) | set(missing) == set(SPEC_ARMS)
    assert ("draft_model" in served) == ("draft_model" in METHODS)


def test_requests_per_run_can_be_set() -> None:
    s = spec.settings(parse("--preset", "fast", "--requests", "2"))
    assert spec.num_prompts(s, 1) == 2 and spec.num_prompts(s, 32) == 2


def test_the_gpu_check_stage_runs_the_bench_and_reports_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's command line and report, with a stand-in for `tandem` (the real one starts
    servers: the --cpu flow and the GPU run do that)."""
    import subprocess

    from tandem_serve.bench.gpu_check.checks import spec as stage
    from tandem_serve.bench.gpu_check.plans import CPU_PLAN
    from tandem_serve.bench.gpu_check.report import Budget

    seen: list[tuple[str, ...]] = []

    def fake(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        seen.append(args)
        path = args[args.index("--json") + 1]
        Path(path).write_text(json.dumps({"rows": [{"cell": "async K=8 | copy | 1"}],
                                          "verdicts": ["a verdict"]}))
        return subprocess.CompletedProcess(list(args), 0, "| the table |\n\n- a verdict", "")

    monkeypatch.setattr(stage, "tandem", fake)
    fig, text = stage.stage_spec(CPU_PLAN, str(tmp_path), Budget(600))
    args = seen[0]
    assert args[:4] == ("bench", "spec", "--preset", "fast")
    assert args.count("--spec-config") == len(fig["arms"]) and "--server-arg=--device=cpu" in args
    assert fig["verdicts"] == ["a verdict"] and "| the table |" in text
