"""`tandem bench stall`: its figures on synthetic stamps, and a short in-process run of both
arms (the real scheduler and runner on the tiny model, timed by the worker's CPU time)."""
from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_serve.bench.stall import main as stall
from tandem_serve.bench.stall.hops import ServerSide, server_side
from tandem_serve.bench.stall.report import (
    Figures,
    client_table,
    figures,
    frontier_table,
    ratio_table,
)
from tandem_serve.bench.stall.scenario import Stamps


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """The in-process run freezes the heap it starts with (as a served worker does): here,
    pytest's.  Thawed after each test, so what later tests leave in cycles is collected."""
    yield
    gc.unfreeze()


def test_figures_count_gaps_inside_the_window_only() -> None:
    stamps = Stamps(streams=[[0.0, 0.01, 0.02, 0.10, 0.11, 0.12, 0.5]],
                    sent=[0.015], first=[0.2], prompt_tokens=[[0.2, 0.21]],
                    window=(0.015, 0.3))
    f = figures(stamps)
    # Gaps ending in the window: 0.02, 0.10, 0.11, 0.12 -> 10, 80, 10, 10 ms.
    assert f.num_gaps == 4 and f.worst_gap_ms == pytest.approx(80)
    assert f.median_gap_ms == pytest.approx(10) and f.worst_ratio == pytest.approx(8)
    assert f.ttft_ms == pytest.approx(185)
    assert f.tokens_per_s == pytest.approx(6 / 0.285)  # 4 stream tokens and 2 of the prompt
    table = ratio_table({"mixed": [f], "prefill-phase": [f]}, "mixed", "prefill-phase")
    assert "| long-prompt TTFT, mixed / prefill-phase | 1.00 | 1.00 |" in table


def test_budget_sweep_arms_and_their_frontier_table() -> None:
    parser = argparse.ArgumentParser()
    stall.add_arguments(parser)
    names = stall.arm_names(parser.parse_args(["--budgets", "96,160"]))
    assert names == ["mixed 96", "mixed 160", "prefill-phase"]
    assert [stall.arm_budget(a, 0) for a in names] == [(False, 96), (False, 160), (True, 0)]
    assert stall.arm_budget("mixed", 200) == (False, 200)
    with pytest.raises(SystemExit, match="--budgets"):
        stall.arm_names(parser.parse_args(["--budgets", "96,x"]))
    with pytest.raises(SystemExit, match="--arms"):
        stall.arm_names(parser.parse_args(["--arms", "mixed,phase"]))
    with pytest.raises(SystemExit, match="runs no server"):
        stall.main(parser.parse_args(["--in-process", "--both"]))

    def f(worst: float, ttft: float) -> Figures:
        return Figures(10.0, 20.0, worst, ttft, ttft, 100.0, 50)

    results = {"mixed 96": [f(25.0, 180.0), f(25.0, 200.0), f(30.0, 190.0)],
               "mixed 160": [f(40.0, 140.0)] * 3,
               "prefill-phase": [f(200.0, 100.0)] * 3}
    table = frontier_table(results, ["mixed 96", "mixed 160"], "prefill-phase")
    # worst 2.5x the median: a step carries 1.5 decode steps of prefill, TTFT >= 1.67x.
    assert "| mixed 96 | 2.50x | 2.00x | 1.90x | 1.67x | 1.00x |" in table
    assert "| mixed 160 | 4.00x | 2.00x | 1.40x | 1.33x | 1.00x |" in table


def test_server_side_gaps_and_pauses_inside_the_window() -> None:
    ms = 1_000_000
    worker = {"role": "gpu-worker", "spans": [
        ["forward", t * ms - 4 * ms, t * ms, 0, k] for k, t in enumerate([10, 20, 30, 70, 80])]
        + [["gc0", 40 * ms, 43 * ms, -1, -1]]}
    post = {"role": "postproc 0", "spans": [["gc2", 50 * ms, 95 * ms, -1, -1],
                                            ["gc2", 500 * ms, 900 * ms, -1, -1]]}
    side = server_side([worker, post], (0.015, 0.075))  # forwards ending at 20, 30, 70 ms
    assert side.num_gaps == 3 and side.worst_gap_ms == pytest.approx(40)
    assert side.median_gap_ms == pytest.approx(10) and side.worst_ratio == pytest.approx(4)
    assert side.gc_ms == {"gpu-worker": pytest.approx(3), "postproc 0": pytest.approx(45)}


def test_the_client_table_sets_served_rounds_against_in_process_ones() -> None:
    def f(worst: float, p99: float) -> Figures:
        return Figures(10.0, p99, worst, 100.0, 100.0, 100.0, 50)

    served = {"mixed": [f(60.0, 30.0), f(40.0, 30.0)]}
    inproc = {"mixed": [f(30.0, 25.0), f(40.0, 25.0)]}
    sides = {"mixed": [ServerSide(10.0, 25.0, 35.0, 40, {"postproc 0": 41.5, "scheduler": 2.0},
                                  worker_wait_pct=3.2, others_cpu_pct=61.0),
                       ServerSide(10.0, 25.0, 40.0, 40, {})]}
    table = client_table(served, inproc, sides)
    assert "| mixed | 1 | 6.0x | 3.0x | 3.0x | 2.5x | 2.00 | 3.5x | 2.5x | 41.5 (postproc 0) " \
        "| 3% | 61% |" in table
    assert "| 2.5x | 0.0 (-) | - | - |" in table  # nothing recorded, /proc not read
    assert "| mixed | median | 5.0x | 3.0x | 3.5x | 2.5x | 1.50 | 3.8x | 2.5x | | | |" in table
    assert "| mixed | 1 | 6.0x | 3.0x |" in client_table(served, None, None)


def test_the_host_meter_reads_this_process_tree() -> None:
    import os
    import time

    from tandem_serve.bench.stall.hops import HostMeter

    with HostMeter(os.getpid()) as host:
        time.sleep(0.05)
    # No gpu worker under this process: its wait stays unknown; the others' CPU is a share.
    assert host.worker_wait_pct == -1.0 and 0.0 <= host.others_cpu_pct <= 100.0 * os.cpu_count()


def test_in_process_run_of_both_arms(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    parser = argparse.ArgumentParser()
    stall.add_arguments(parser)
    out = tmp_path / "stall.json"
    args = parser.parse_args(["--in-process", "--rounds", "1", "--streams", "2",
                              "--prompts", "2", "--prompt-len", "300", "--interval", "0.2",
                              "--json", str(out)])
    assert stall.main(args) == 0
    printed = capsys.readouterr().out
    assert "| mixed | 1 |" in printed and "| prefill-phase | 1 |" in printed
    arms = json.loads(out.read_text())["arms"]
    mixed, phase = arms["mixed"][0], arms["prefill-phase"][0]
    # A 300-token prompt's prefill is one forward in the baseline: the streams wait for it.
    assert phase["worst_gap_ms"] > mixed["worst_gap_ms"]
    assert mixed["num_gaps"] > 0 and phase["num_gaps"] > 0


def test_the_gpu_check_stage_runs_the_sweep_and_reports_its_frontier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's command line (the experiment's model and flags, a small KV cache per server)
    and its figures, with a stand-in for `tandem` (the real one runs the scenario: the --cpu
    flow and the GPU run do that)."""
    import subprocess
    from dataclasses import asdict

    from tandem_serve.bench.gpu_check.checks import stall as stage
    from tandem_serve.bench.gpu_check.plans import GPU_PLAN
    from tandem_serve.bench.gpu_check.report import Budget

    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(stage, "experiment_model",
                        lambda plan, out: ("/m/llama3-8b-shaped", ["--load-format", "dummy"]))

    def fake(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        seen.append(args)
        f = asdict(Figures(10.0, 20.0, 25.0, 120.0, 130.0, 100.0, 50))
        phase = {**f, "worst_gap_ms": 190.0, "ttft_ms": 100.0}
        Path(args[args.index("--json") + 1]).write_text(json.dumps(
            {"arms": {"mixed 512": [f, f], "mixed 2048": [f, f],
                      "prefill-phase": [phase, phase]}}))
        return subprocess.CompletedProcess(list(args), 0, "| the tables |", "")

    monkeypatch.setattr(stage, "tandem", fake)
    fig, text = stage.stage_stall(GPU_PLAN, str(tmp_path), Budget(600))
    args = seen[0]
    assert args[:4] == ("bench", "stall", "--model", "/m/llama3-8b-shaped")
    assert args[4:8] == ("--budgets", "256,512", "--rounds", "3")  # the full flow's
    server = [a.removeprefix("--server-arg=") for a in args if a.startswith("--server-arg=")]
    assert server == ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16",
                      "--kv-cache-memory", "4"]
    assert [r["arm"] for r in fig["frontier"]] == ["mixed 512", "mixed 2048"]
    row = fig["frontier"][0]
    assert row["worst_ratio"] == pytest.approx(2.5) and row["ttft_ratio"] == pytest.approx(1.2)
    assert "| the tables |" in text
