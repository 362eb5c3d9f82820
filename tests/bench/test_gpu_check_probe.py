"""gpu-check's bandwidth bound and probe stage, with stand-ins for the device: the bound's
arithmetic, the step stage's ratio, the probe's cells and its table."""
from __future__ import annotations

import json
import pathlib
import subprocess
import types
from typing import Any

import numpy as np
import pytest

from tandem_serve.bench.gpu_check import bound
from tandem_serve.bench.gpu_check.checks import probe
from tandem_serve.bench.gpu_check.models import LLAMA3_8B, LLAMA3_VOCAB
from tandem_serve.bench.gpu_check.plans import GPU_PLAN
from tandem_serve.bench.gpu_check.report import Budget

GIB = 2**30


def llama3_probe_folder(tmp_path: pathlib.Path) -> str:
    model = tmp_path / "llama3-8b-probe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": LLAMA3_VOCAB, **LLAMA3_8B}))
    return str(model)


def test_the_bound_is_the_bytes_a_step_reads_over_the_read_bandwidth() -> None:
    # 16 GB of weights at 4,000 GB/s: 4 ms; 64 rows x 1,000 tokens x 128 KiB of K and V add
    # 8.39 GB: 2.1 ms more.  No factor of two: the probe's bandwidth is bytes *read*.
    assert bound.ideal_step_ms(16e9, 4000.0) == pytest.approx(4.0)
    read = bound.step_read_bytes(16_000_000_000, 131072, 64, 1000)
    assert read == 16_000_000_000 + 64 * 1000 * 131072
    assert bound.ideal_step_ms(read, 4000.0) == pytest.approx(4.0 + 8.388608 / 4.0)


def test_the_8b_shape_reads_its_weights_and_128_kib_of_kv_per_token(
        tmp_path: pathlib.Path) -> None:
    from tandem_serve.bench.gpu_check.models import decode_weight_bytes, kv_bytes_per_token

    model = llama3_probe_folder(tmp_path)
    # 32 layers x (q,k,v,o 4096x6144 + 4096x4096, MLP 3x4096x14336) + the 128,256 x 4096 head
    layers = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    assert decode_weight_bytes(model, "bfloat16") == 2 * (layers + LLAMA3_VOCAB * 4096)
    assert kv_bytes_per_token(model, "bfloat16") == 32 * 2 * 8 * 128 * 2  # 128 KiB


def test_the_read_probe_times_a_reduction_and_divides_bytes_by_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def fake_fastest(fn: Any, device: str, passes: int) -> float:
        seen.append(passes)
        fn()  # a sum over the tensor: reads it once, writes nothing
        return 0.002

    monkeypatch.setattr(bound, "fastest", fake_fastest)
    assert bound.read_bandwidth_gbs("cpu", nbytes=8 << 20) == pytest.approx(
        (8 << 20) / 0.002 / 1e9)
    assert seen == [bound.READ_PASSES]
    assert bound.read_bandwidth_gbs("cpu", nbytes=8 << 20, passes=2) > 0


def test_the_step_stage_s_ratio_is_ours_over_the_read_bound(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step at twice the bound reads 2.00 (the copy-based bound halved the bandwidth a
    second time and read it as 1.00)."""
    from tandem_serve.bench.gpu_check import stages
    from tandem_serve.bench.gpu_check.models import decode_weight_bytes, kv_bytes_per_token

    model = llama3_probe_folder(tmp_path)
    monkeypatch.setattr(stages, "experiment_model",
                        lambda plan, out: (model, ["--load-format", "dummy"]))
    weights = decode_weight_bytes(model, "bfloat16")
    kv = kv_bytes_per_token(model, "bfloat16")
    context = GPU_PLAN.step_prompt_len + (GPU_PLAN.step_steps + 1) / 2
    want = {b: (weights + b * context * kv) / 4000e9 * 1e3 for b in (1, 32)}

    def fake_tandem(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        rows = [{"batch": b, "ours_ms": 2 * ms, "hf_ms": None, "ratio": None}
                for b, ms in want.items()]
        pathlib.Path(args[args.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return subprocess.CompletedProcess(list(args), 0, "", "")

    monkeypatch.setattr(stages, "tandem", fake_tandem)
    fig, text = stages.stage_step(GPU_PLAN, str(tmp_path), Budget(600),
                                  read_gbs=lambda device: 4000.0)
    assert fig["read_bandwidth_gbs"] == 4000.0
    for r in fig["rows"]:
        assert r["bound_ms"] == pytest.approx(want[r["batch"]])
    assert f"| 32 | {2 * want[32]:.2f} | – | – | {want[32]:.3f} | 2.00 |" in text


class FakeRunner:
    """What the probe's cells use of a ModelRunner: plans in, a vocabulary size."""

    vocab_size = 1000

    def __init__(self) -> None:
        self.plans: list[Any] = []

    def execute(self, plan: Any, publisher: Any) -> None:
        self.plans.append(plan)


def test_a_probe_cell_decodes_from_cached_prompts_and_times_whole_plans() -> None:
    runner = FakeRunner()
    clock_calls: list[int] = []

    def clock(fn: Any) -> float:
        fn()
        clock_calls.append(len(runner.plans))
        return 8.0 * len(clock_calls)  # ms of each timed plan of 8 steps: 8, 16, 24

    cells = probe.StepProbe(runner, None, per_req=70, clock=clock)
    c = cells.cell(4, 1024, 24)
    setup, warm, *timed = runner.plans
    assert [p.num_steps for p in runner.plans] == [1, 8, 8, 8, 8] and len(timed) == 3
    assert [n.request_id for n in setup.new] == [0, 1, 2, 3] and setup.drop == []
    for i, n in enumerate(setup.new):
        assert len(n.prompt_ids) == 1024 and n.num_cached_tokens == 1023
        assert n.num_prefill_tokens == 0  # the first step decodes the prompt's last token
        assert n.block_ids == list(range(70 * i, 70 * (i + 1)))
        assert n.sampling.max_new_tokens > 10**6 and not n.sampling.stop_token_ids
        assert np.all(n.prompt_ids < FakeRunner.vocab_size)
    assert not warm.new and clock_calls == [3, 4, 5]
    assert c == {"batch": 4, "context": 1024, "ms": 2.0, "min_ms": 1.0, "steps": 24,
                 "mean_context": 1024 + 1 + 8 + 23 / 2}
    cells.cell(2, 4096, 8)  # the next cell's fresh rows replace these
    assert runner.plans[5].drop == [0, 1, 2, 3]
    assert [n.request_id for n in runner.plans[5].new] == [4, 5]


def test_the_probe_stage_tables_every_backend_batch_and_context(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU plan's cells per backend (a stand-in for the arm processes), attention's share
    from the no-attention arm, the bound from the bytes read; an arm that ran out of time
    keeps its cells and is named."""
    model = llama3_probe_folder(tmp_path)
    monkeypatch.setattr(probe, "probe_model", lambda plan, out: (model, "dummy"))
    monkeypatch.setattr(probe, "device_backends", lambda device, dtype: (["flex", "sdpa"], ""))
    calls: list[tuple[str, list[str]]] = []

    def fake_arm(arm: str, args: list[str], timeout: float, path: str) -> dict[str, Any]:
        calls.append((arm, args))
        ms = {probe.NO_ATTENTION: 5.0, "flex": 10.0, "sdpa": 20.0}[arm]
        cells = [{"batch": b, "context": c, "ms": 1.5 * ms * (1 + c / 4096),
                  "min_ms": ms * (1 + c / 4096), "mean_context": c + 20.5, "steps": 16}
                 for c in GPU_PLAN.probe_contexts for b in GPU_PLAN.probe_batches]
        out: dict[str, Any] = {"read_gbs": 4000.0 if arm == "flex" else 3900.0,
                               "cells": cells, "load_s": 3.0}
        if arm == "sdpa":
            out.update(cells=cells[:3], error="timed out after 40 s")
        return out

    fig, text = probe.stage_probe(GPU_PLAN, str(tmp_path), Budget(120), runner=fake_arm)
    assert [a for a, _ in calls] == [probe.NO_ATTENTION, "flex", "sdpa"]
    assert "--no-attention" in calls[0][1]
    assert calls[1][1][-2:] == ["--attention-backend", "flex"]
    args = calls[1][1]
    assert args[args.index("--batches") + 1] == "1,8,32,64,128"
    assert args[args.index("--contexts") + 1] == "1024,4096"
    assert args[args.index("--load-format") + 1] == "dummy"
    rows = fig["rows"]
    assert len(rows) == 10 + 10 + 3  # no attention, flex, and sdpa's three cells
    assert fig["read_gbs"] == 4000.0 and fig["errors"] == {"sdpa": "timed out after 40 s"}
    flex = {(r["batch"], r["context"]): r for r in rows if r["backend"] == "flex"}
    r = flex[64, 4096]
    assert r["attention_share"] == pytest.approx(0.5)
    want = (fig["weight_bytes"] + 64 * (4096 + 20.5) * fig["kv_bytes_per_token"]) / 4000e9 * 1e3
    assert r["ideal_ms"] == pytest.approx(want)
    assert r["over_ideal"] == pytest.approx(20.0 / want)  # of the fastest plan
    assert all(r["attention_share"] is None for r in rows if r["backend"] == probe.NO_ATTENTION)
    lines = [line for line in text.splitlines() if line.startswith("| flex |")]
    assert len(lines) == 10 and "| flex | 64 | 4096 | 30.000 | 20.000 | 50% |" in text
    assert "- sdpa: timed out after 40 s" in text


def test_the_probe_fails_when_no_backend_measured_anything(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = llama3_probe_folder(tmp_path)
    monkeypatch.setattr(probe, "probe_model", lambda plan, out: (model, "dummy"))
    plan = types.SimpleNamespace(**{**GPU_PLAN.__dict__, "probe_backends": ("nope",)})

    def fake_arm(arm: str, args: list[str], timeout: float, path: str) -> dict[str, Any]:
        if arm == probe.NO_ATTENTION:
            return {"read_gbs": 1.0, "cells": [{"batch": 1, "context": 8, "ms": 1.0,
                                                "min_ms": 1.0, "mean_context": 9}]}
        return {"cells": [], "error": "exit 1: --attention-backend 'nope' is not one of"}

    with pytest.raises(RuntimeError, match="nope: exit 1"):
        probe.stage_probe(plan, str(tmp_path), Budget(60), runner=fake_arm)  # type: ignore[arg-type]
