"""`tandem bench ab` end to end at a tiny scale: every arm on a fresh server, the peers on
the same workload, and the table / JSON / PNG it promises.  Speed is never asserted."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess

import pytest

from tandem_serve.ipc.process import CLI

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
HAVE_TRANSFORMERS_SERVE = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn",
                                                                       "accelerate"))


def run_ab(model: pathlib.Path, out: pathlib.Path, peers: str,
           *extra: str) -> tuple[dict, str]:
    cmd = [*CLI, "bench", "ab", "--model", str(model),
           "--steps", "2", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
           "--max-concurrency", "3", "--peers", peers, *extra,
           "--output-json", str(out / "ab.json"), "--png", str(out / "ab.png")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "ab.json").read_text()), proc.stdout


@pytest.mark.slow
def test_bench_ab_runs_every_arm_and_the_generate_bound(fast_model_dir: pathlib.Path,
                                                        tmp_path: pathlib.Path) -> None:
    # One K: each arm kind (sync, async, async unpaced) once, a fresh server each (~9 s);
    # which arms --steps makes is tests/bench/test_ab_table.py's.
    results, stdout = run_ab(fast_model_dir, tmp_path, "hf-generate", "--unpaced")
    arms = ["sync K=2", "async K=2", "async unpaced K=2"]
    assert list(results) == arms + ["hf generate()"]
    for name in arms:
        r = results[name]
        assert r["completed"] == 6, name
        assert 0.0 <= r["device_idle_pct"] <= 100.0
        assert 0.0 <= r["steady_idle_pct"] <= 100.0
        assert r["forward_ms_per_plan"] > 0 and r["plans"] > 0
        # CPU seconds for every process of the server tree, and for the load generator.
        assert {"frontend", "scheduler", "gpu-worker", "postproc 0", "postproc 1",
                "load generator"} <= set(r["cpu_s"]), r["cpu_s"]
        assert r["cpu_s"]["gpu-worker"] > 0
        # Fixed output lengths: every arm delivers the same tokens, nothing is wasted.
        assert r["delivered_tokens"] == 6 * 8 and r["wasted_tokens"] == 0
    assert results["hf generate()"]["completed"] == 6
    # Without sync K=1 the ratios' base is the first sync arm.
    assert "TPOT vs sync K=2" in stdout and "| sync K=2 |" in stdout
    assert "1.00× | 1.00× |" in stdout
    assert "async K=2 output throughput =" in stdout and "hf generate()'s" in stdout
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRANSFORMERS_SERVE, reason="needs the bench extra")
# About 45 s of a 2-core CI run for a benchmark peer's driver, not for Tandem: run it with
# TANDEM_TEST_PEERS=1 (the README's Development section says when).
@pytest.mark.skipif(not os.environ.get("TANDEM_TEST_PEERS"),
                    reason="the transformers serve peer: set TANDEM_TEST_PEERS=1")
def test_bench_ab_drives_transformers_serve_on_the_same_checkpoint(
        fast_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cmd = [*CLI, "bench", "ab", "--model", str(fast_model_dir),
           "--steps", "1", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
           "--max-concurrency", "2", "--peers", "transformers-serve",
           "--output-json", str(tmp_path / "ab.json"), "--png", str(tmp_path / "ab.png")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "ab.json").read_text())
    peer = results["transformers serve"]
    assert peer["completed"] == 4
    assert peer["cpu_s"]["transformers serve"] > 0
    assert "transformers serve's" in proc.stdout
