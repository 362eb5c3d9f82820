"""`scripts/gpu-check` proves itself on the CPU: the whole flow, shortened, and the budget."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def gpu_check(out: pathlib.Path, *flags: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *flags],
                          cwd=out.parent, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ""})
    results = json.loads((out / "results.json").read_text())
    assert (out / "report.md").exists(), proc.stderr[-2000:]
    return proc.returncode, results


@pytest.mark.slow
def test_quick_cpu_flow_runs_every_stage(tmp_path: pathlib.Path) -> None:
    rc, results = gpu_check(tmp_path / "out", "--quick")
    stages = results["stages"]
    assert rc == 0, stages
    assert {n: s["status"] for n, s in stages.items()} == {
        "environment": "passed", "gpu tests": "skipped", "parity": "passed",
        "features": "skipped", "probe": "passed",
        "experiment": "passed", "profile": "passed", "step": "passed", "quantized": "passed",
        "families": "passed", "kv fp8": "skipped", "spec": "skipped", "stall": "skipped",
        "arrivals": "skipped"}
    probe = stages["probe"]["figures"]  # the tiny model, one batch and context
    assert {r["backend"] for r in probe["rows"]} >= {"no attention"} and probe["read_gbs"] > 0
    assert all(r["ms"] > 0 and r["ideal_ms"] > 0 for r in probe["rows"])
    assert stages["parity"]["figures"]["float32"]["exact"] == 1
    arms = stages["experiment"]["figures"]
    # The quick plan's arms: the sync loop, K=8 plans and the prefill phase (the --cpu and
    # GPU flows add sync K=8).
    quick_arms = ("sync K=1", "async K=8", "async K=8 prefill-phase")
    assert [a for a in arms if isinstance(arms[a], dict)] == list(quick_arms)
    for arm in quick_arms:
        assert arms[arm]["completed"] == arms["num_prompts"]
        assert arms[arm]["mean_tpot_ms"] > 0 and arms[arm]["forward_ms_per_plan"] > 0
    assert stages["profile"]["figures"]["plans"] >= 3
    assert os.path.exists(stages["profile"]["figures"]["torch_trace"])
    step = stages["step"]["figures"]
    assert step["rows"][0]["batch"] == 1 and step["bandwidth_bound_ms"] > 0
    quantized = stages["quantized"]["figures"]["rows"]  # float32 next to FP8 (dummy weights)
    assert set(quantized) == {"float32", "ct-fp8"}
    assert all(rows[0]["ours_ms"] > 0 and rows[0]["weight_bytes"] > 0
               for rows in quantized.values())
    families = stages["families"]["figures"]  # an MoE and a Gemma 3 shape, dummy weights
    assert set(families) == {"qwen3-moe", "gemma3"}
    assert all(rows[0]["ours_ms"] > 0 for rows in families.values())
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| async K=8 |" in report and "TPOT vs sync K=1" in report
    assert "| sync K=1 |" in report and "| 1.00× |" in report  # the ratios' base row
    assert "async K=8 (mixed steps) / async K=8 prefill-phase: ITL p99" in report


def test_stages_the_budget_cannot_hold_are_skipped_and_named(tmp_path: pathlib.Path) -> None:
    rc, results = gpu_check(tmp_path / "out", "--cpu", "--budget-s", "1")
    assert rc == 0
    skipped = {n: s["error"] for n, s in results["stages"].items() if s["status"] == "skipped"}
    assert {"gpu tests", "parity", "features", "probe", "experiment", "step", "quantized",
            "families", "kv fp8", "spec", "stall", "arrivals"} <= set(skipped)
    assert all("budget" in why for n, why in skipped.items() if n != "profile")


def test_the_gpu_plan_s_quantized_folders_are_served_formats(tmp_path: pathlib.Path) -> None:
    """What the GPU run's quantized stage asks for on the seed's Llama-3-8B shape: every
    format parses, takes group 128, and fits the shape (checked here: no GPU needed)."""
    from tandem_serve.bench.gpu_check.checks.quantized import quantized_folder
    from tandem_serve.bench.gpu_check.models import LLAMA3_8B
    from tandem_serve.bench.gpu_check.plans import GPU_PLAN
    from tandem_serve.gpu_worker.models.config import ModelArgs
    from tandem_serve.gpu_worker.models.quant.split import split_problems

    model = tmp_path / "llama3-8b-shaped"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, **LLAMA3_8B}))
    kinds = set()
    for fmt in GPU_PLAN.quant_formats:
        folder = quantized_folder(str(model), str(tmp_path / "out"), fmt)
        args = ModelArgs.from_hf_config(json.loads(pathlib.Path(folder, "config.json")
                                                   .read_text()))
        assert args.quant is not None and split_problems(args, 1) == []
        assert args.quant.group_size in (0, 128)
        kinds.add(args.quant.kind)
    assert kinds == {"ct-fp8", "fp8-block", "gptq"}


def test_stages_runs_only_the_named_ones_and_refuses_unknown_names(tmp_path: pathlib.Path
                                                                   ) -> None:
    rc, results = gpu_check(tmp_path / "out", "--cpu", "--budget-s", "60", "--stages",
                            "environment")
    assert rc == 0
    status = {n: (s["status"], s.get("error", "")) for n, s in results["stages"].items()}
    assert status.pop("environment")[0] == "passed"
    assert all(s == ("skipped", "not among --stages") for n, s in status.items()
               if n != "profile"), status
    proc = subprocess.run([sys.executable, str(SCRIPT), "--stages", "environment,stal"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 2 and "--stages: unknown ['stal']" in proc.stderr


def test_the_arrivals_stage_sets_mixed_steps_against_the_baseline(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its arms, servers and workload, and the ratios it reports, with a stand-in arm runner
    (the --cpu flow and the GPU run serve it for real)."""
    import types

    from tandem_serve.bench.gpu_check import models
    from tandem_serve.bench.gpu_check.checks import arrivals as stage
    from tandem_serve.bench.gpu_check.plans import GPU_PLAN
    from tandem_serve.bench.gpu_check.report import Budget

    monkeypatch.setattr(models, "experiment_model",
                        lambda plan, out: ("/m/llama3-8b-shaped", ["--load-format", "dummy"]))
    monkeypatch.setattr(models, "full_weight_bytes", lambda model, dtype: 16 * 2**30)
    monkeypatch.setattr(models, "kv_cache_gib", lambda weight_bytes: 101.0)
    monkeypatch.setattr(stage, "Workload", types.SimpleNamespace(build=lambda bench: bench))
    calls = []

    def fake_run_arm(model: str, arm: object, work: object, flags: list[str]) -> dict:
        calls.append((arm, work, flags))
        phase = arm.prefill_phase  # type: ignore[attr-defined]
        return {k: (200.0 if phase else 100.0) for k in stage.KEYS}

    monkeypatch.setattr(stage, "run_arm", fake_run_arm)
    fig, text = stage.stage_arrivals(GPU_PLAN, str(tmp_path), Budget(600))
    assert [a.name for a, _, _ in calls] == ["async K=8", "async K=8 prefill-phase"]
    work, flags = calls[0][1], calls[0][2]
    assert (work.input_len, work.output_len, work.request_rate,  # type: ignore[attr-defined]
            work.num_prompts) == (1024, 128, 10.0, 150)  # type: ignore[attr-defined]
    assert flags == ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16",
                     "--max-num-seqs", "256", "--kv-cache-memory", "101"]
    assert fig["async K=8"]["p99_itl_ms"] == 100.0 and fig["num_prompts"] == 150
    assert "async K=8 (mixed steps) / async K=8 prefill-phase: ITL p99 0.50×" in text


def test_the_kv_fp8_stage_compares_the_caches(tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Its servers' flags, the agreement it computes and its table, with stand-ins for the
    servers (the --cpu flow serves them for real; `tests/gpu_worker/test_kv_fp8.py` and
    `tests/e2e` prove the fp8 cache itself)."""
    import types

    from tandem_serve.bench.gpu_check.checks import kv_fp8 as stage
    from tandem_serve.bench.gpu_check.plans import CPU_PLAN, GPU_PLAN
    from tandem_serve.bench.gpu_check.report import Budget

    monkeypatch.setattr(stage, "tiny_model", lambda out, preset: "/m/tiny")
    monkeypatch.setattr(stage, "Workload", types.SimpleNamespace(build=lambda bench: bench))

    def tokens(fp8: bool, jobs: list[tuple[str, int]]) -> list[list[str]]:
        return [["a", "b", "x" if fp8 and i == 0 else "c"] for i in range(len(jobs))]

    for plan, model, shared in ((CPU_PLAN, "/m/tiny", True),
                                (GPU_PLAN, "/m/llama3-8b-shaped", False)):
        served: list[list[str]] = []
        asked: list[int] = []

        def fake_served(model: str, flags: list[str], jobs: list[tuple[str, int]],
                        into: list[list[str]] = served) -> list:
            into.append(flags)
            return tokens("fp8" in flags, jobs)

        arms: list[list[str]] = []

        def fake_run_arm(model: str, arm: object, work: object, flags: list[str],
                         after: object, into: list[list[str]] = arms) -> dict:
            into.append(flags)
            fp8 = flags[-1] == "fp8"
            after(7)  # type: ignore[operator]
            return {"mean_tpot_ms": 12.0 if fp8 else 10.0, "completed": 8,
                    "output_throughput": 100.0}

        def fake_tokens_at(port: int, jobs: list[tuple[str, int]],
                           into: list[list[str]] = arms, seen: list[int] = asked) -> list:
            seen.append(port)
            return tokens(into[-1][-1] == "fp8", jobs)

        monkeypatch.setattr(stage, "serve_flags",
                            lambda plan, out, model=model: (model, ["--device", plan.device]))
        monkeypatch.setattr(stage, "served_tokens", fake_served)
        monkeypatch.setattr(stage, "tokens_at", fake_tokens_at)
        monkeypatch.setattr(stage, "run_arm", fake_run_arm)
        monkeypatch.setattr(stage, "total_blocks",
                            lambda port, into=arms: 400 if into[-1][-1] == "fp8" else 100)
        fig, text = stage.stage_kv_fp8(plan, str(tmp_path), Budget(600))
        # On the CPU each cache's one server answers both parts; on the GPU the agreement
        # has float32 servers of its own.
        assert fig["shared_servers"] is shared
        assert [f[-1] for f in served] == ([] if shared else ["auto", "fp8"])
        assert asked == ([7, 7] if shared else [])
        assert [f[-1] for f in arms] == ["auto", "fp8"]
        assert "--kv-cache-memory" in arms[0]  # both caches get the same memory
        a = fig["agreement"]
        assert a["prompts"] == plan.kv_prompts and a["exact_prompts"] == plan.kv_prompts - 1
        assert a["position_agreement"] == pytest.approx(1 - 1 / (3 * plan.kv_prompts))
        assert fig["fp8"]["num_kv_blocks"] == 4 * fig["auto"]["num_kv_blocks"]
        assert "fp8 / auto: 4.00x the blocks, 1.20x the TPOT." in text


def test_the_window_flow_and_the_experiment_s_flags_reach_the_plan(
        tmp_path: pathlib.Path) -> None:
    rc, results = gpu_check(tmp_path / "out", "--cpu", "--flow", "window", "--budget-s", "1",
                            "--experiment-prompts", "7", "--experiment-arms",
                            "async-k8,sync-k1", "--no-profile", "--max-num-seqs", "300",
                            "--probe-backends", "flex,sdpa")
    assert rc == 0
    s = results["settings"]
    assert s["flow"] == "window (environment, probe, experiment, stall, gpu tests, parity)"
    assert (s["experiment_prompts"], s["experiment_arms"], s["profile"],
            s["experiment_max_num_seqs"], s["probe_backends"]) == (
        7, ["async-k8", "sync-k1"], False, 300, ["flex", "sdpa"])
    stages = results["stages"]
    assert list(stages)[:6] == ["environment", "probe", "experiment", "stall", "gpu tests",
                                "parity"]
    assert all(stages[n]["error"] == "not in the window flow" for n in list(stages)[6:])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--experiment-arms", "async-k8,k9"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 2 and "--experiment-arms: unknown ['k9']" in proc.stderr


def test_the_experiment_runs_the_named_arms_with_an_explicit_count_and_free_memory(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window's experiment on the GPU plan with stand-in servers: its two arms, 200
    prompts said to be asked for, 256 rows and a KV cache from free memory, no profile."""
    import types

    from tandem_serve.bench.gpu_check import models, stages
    from tandem_serve.bench.gpu_check.main import make_plan
    from tandem_serve.bench.gpu_check.report import Budget

    monkeypatch.setattr(models, "experiment_model",
                        lambda plan, out: ("/m/llama3-8b-shaped", ["--load-format", "dummy"]))
    monkeypatch.setattr(models, "full_weight_bytes", lambda model, dtype: 16 * 2**30)
    monkeypatch.setattr(models, "kv_cache_gib", lambda weight_bytes: 101.0)
    monkeypatch.setattr(stages, "Workload", types.SimpleNamespace(build=lambda bench: bench))
    calls: list[tuple[str, object, list[str], object]] = []

    def fake_run_arm(model: str, arm: object, work: object, flags: list[str],
                     hook: object) -> dict:
        calls.append((arm.name, work, flags, hook))  # type: ignore[attr-defined]
        return {"mean_tpot_ms": 20.0 if arm.async_mode else 30.0,  # type: ignore[attr-defined]
                "completed": 200}

    monkeypatch.setattr(stages, "run_arm", fake_run_arm)
    plan = make_plan(cpu=False, flow="window")
    fig, text = stages.stage_experiment(plan, str(tmp_path), Budget(170), {})
    assert [c[0] for c in calls] == ["async K=8", "sync K=1"]
    assert all(c[3] is None for c in calls)  # --no-profile: no hook on the async arm
    work, flags = calls[0][1], calls[0][2]
    assert work.num_prompts == 200  # type: ignore[attr-defined]
    assert flags == ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16",
                     "--max-num-seqs", "256", "--kv-cache-memory", "101"]
    assert fig["num_prompts"] == 200 and fig["num_prompts_why"].startswith("as asked")
    assert "200 prompts per arm (as asked (--experiment-prompts))" in text
    assert "| async K=8 | – | 20.00 |" in text and "0.67×" in text
    # Without a count the budget picks one, and the report says when it was the floor.
    cpu = make_plan(cpu=True)
    calls.clear()
    fig, text = stages.stage_experiment(cpu, str(tmp_path), Budget(1), {})
    assert fig["num_prompts"] == cpu.min_prompts and "the budget's floor" in text
    assert len(calls) == 4


def test_the_quantized_stage_fits_the_tiny_widths_to_int4_groups(
        tmp_path: pathlib.Path) -> None:
    """The tiny default preset's MLP (688) takes no int4 group: the stage serves every arm a
    shape rounded up to multiples of 128 instead (it failed the --cpu flow before)."""
    from tandem_serve.bench.gpu_check.checks.quantized import fitted_model, quantized_folder
    from tandem_serve.gpu_worker.models.config import ModelArgs
    from tandem_serve.harness.tiny_model import PRESETS

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    p = PRESETS["default"]
    (tiny / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
        "hidden_size": p.hidden_size, "intermediate_size": p.intermediate_size,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    (tiny / "tokenizer.json").write_text("{}")
    assert fitted_model(str(tiny), str(tmp_path), ("ct-fp8",)) == str(tiny)  # no groups
    fitted = fitted_model(str(tiny), str(tmp_path), ("ct-fp8", "gptq"))
    config = json.loads(pathlib.Path(fitted, "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (
        256, 768, 64)
    assert pathlib.Path(fitted, "tokenizer.json").exists()
    folder = quantized_folder(fitted, str(tmp_path), "gptq")
    args = ModelArgs.from_hf_config(json.loads(pathlib.Path(folder, "config.json").read_text()))
    assert args.quant is not None and args.quant.group_size == 128


def test_the_window_flow_fits_nine_minutes() -> None:
    """Its stages' slices leave time to end an overrunning one within 540 s, and each slice
    holds what its stage needs at least (else it would always be skipped)."""
    from tandem_serve.bench.gpu_check.main import END_MARGIN_S, GUARD_GRACE_S, make_plan
    from tandem_serve.bench.gpu_check.plans import FLOWS, NEEDS
    from tandem_serve.bench.gpu_check.supervise import END_GRACE_S

    flow = FLOWS["window"]
    plan = make_plan(cpu=False, flow="window")
    assert flow.budget_s <= 540 and set(plan.stage_caps) == set(flow.stages)
    assert sum(plan.stage_caps.values()) + GUARD_GRACE_S + END_GRACE_S + 5 <= flow.budget_s
    assert END_MARGIN_S >= GUARD_GRACE_S + END_GRACE_S
    assert all(plan.stage_caps[s] >= NEEDS[s][0] for s in flow.stages)
    assert plan.experiment_arms == ("async-k8", "sync-k1") and not plan.profile
    assert plan.experiment_prompts == 200 and plan.experiment_max_num_seqs == 256
    assert plan.stall_args[:2] == ("--budgets", "256,512")


def test_only_the_quick_plan_leaves_an_experiment_arm_out() -> None:
    """The tests' --quick flow runs three arms for CI time; the --cpu and GPU flows run all."""
    from tandem_serve.bench.gpu_check.plans import (
        CPU_PLAN,
        EXPERIMENT_ARMS,
        GPU_PLAN,
        QUICK_PLAN,
    )

    assert CPU_PLAN.experiment_arms == GPU_PLAN.experiment_arms == tuple(EXPERIMENT_ARMS)
    assert set(EXPERIMENT_ARMS) - set(QUICK_PLAN.experiment_arms) == {"sync-k8"}
