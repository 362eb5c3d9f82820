"""`tandem bench step` on a tiny checkpoint: it runs, reports both engines, and its trace
mode counts spans.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu_worker.runner_driver import checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the runner tests' setting


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The GQA llama checkpoint of the runner tests."""
    return checkpoint(tmp_path_factory.mktemp("runner-ckpts"), "llama-gqa")


def test_bench_step_runs(llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    from tandem_serve.bench.step import main as bench_step

    parser = argparse.ArgumentParser()
    bench_step.add_arguments(parser)
    out = tmp_path / "step.json"
    args = parser.parse_args(["--model", llama, "--batch-sizes", "1,3", "--steps", "6",
                              "--num-scheduler-steps", "4", "--prompt-len", "20",
                              "--repeats", "1", "--json", str(out)])
    assert bench_step.main(args) == 0
    assert "| 3 |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    # HF's figure is a difference of two timings: only its presence is checked here.
    assert all(r["ours_ms"] > 0 and r["hf_ms"] is not None for r in report["rows"])


def test_bench_step_trace_reports_span_costs(llama: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    from tandem_serve.bench.step import main as bench_step
    from tandem_serve.ipc.tracing import TRACER

    parser = argparse.ArgumentParser()
    bench_step.add_arguments(parser)
    out = tmp_path / "trace.json"
    args = parser.parse_args(["--model", llama, "--batch-sizes", "2", "--steps", "8",
                              "--num-scheduler-steps", "4", "--prompt-len", "12",
                              "--repeats", "2", "--trace", "--json", str(out)])
    assert bench_step.main(args) == 0
    assert "| 2 |" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    # Per K=4 plan: forward + publish per step, apply + collect + the loop's idle per plan.
    assert row["spans_per_step"] == pytest.approx(2 + 3 / 4)
    # Costs only exist; the machine is shared, so no figure is asserted.
    assert row["off_ms"] > 0 and row["on_ms"] > 0 and row["span_on_ns"] > 0
    assert not TRACER.enabled  # the process's tracer is left off


def test_bench_step_guided_compares_each_kind_to_unguided(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    from tandem_serve.bench.step import main as bench_step
    from tests.gpu_worker.guided_utils import guided_checkpoint

    model = guided_checkpoint(tmp_path)  # has a tokenizer: the tables need one
    parser = argparse.ArgumentParser()
    bench_step.add_arguments(parser)
    out = tmp_path / "guided.json"
    args = parser.parse_args(["--guided", "--model", model, "--batch-sizes", "4", "--steps",
                              "4", "--num-scheduler-steps", "2", "--prompt-len", "10",
                              "--repeats", "1", "--json", str(out)])
    assert bench_step.main(args) == 0
    assert "| grammar |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["arm"]: r for r in report["rows"]}
    assert list(rows) == ["unguided", "regex", "choice", "json", "grammar"]
    assert rows["unguided"]["guided_rows"] == 0 and rows["unguided"]["ratio"] == 1.0
    assert all(rows[k]["guided_rows"] == 2 and rows[k]["ms"] > 0 for k in list(rows)[1:])
    assert "states x" in rows["json"]["detail"]
