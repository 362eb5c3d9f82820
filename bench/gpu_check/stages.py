"""The stages of `scripts/gpu-check` beside the others: the environment, the `gpu`-marked
tests, the seed's experiment (with a `tandem profile` of its async arm) and decode ms/step
next to the memory-bandwidth bound. Each returns (figures, markdown)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

from tandem_serve.bench.ab.tables import prefill_ratios
from tandem_serve.bench.gpu_check.bound import ideal_step_ms, read_bandwidth_gbs, step_read_bytes
from tandem_serve.bench.gpu_check.models import (
    decode_weight_bytes,
    experiment_model,
    kv_bytes_per_token,
    serve_flags,
)
from tandem_serve.bench.gpu_check.plans import Plan, experiment_arm
from tandem_serve.bench.gpu_check.report import Budget, experiment_table, say, step_table
from tandem_serve.bench.gpu_check.supervise import run_tree, tandem
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.harness.arms import Arm, run_arm
from tandem_serve.harness.processes import REPO_ROOT


def stage_environment(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    import torch

    fig: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda_build": torch.version.cuda, "cuda_available":
                           torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        fig.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count)
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            fig["driver"] = q.stdout.strip()
    fig["cpu_cores"] = len(os.sched_getaffinity(0))
    versions = {}
    for name in ("transformers", "tokenizers", "numpy", "grpcio", "pyzmq", "msgpack",
                 "outlines-core", "llguidance", "fastapi", "uvicorn", "peft", "flash-attn"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    fig["packages"] = versions
    rows = "\n".join(f"| {k} | {v} |" for k, v in fig.items() if k != "packages")
    pkgs = ", ".join(f"{k} {v}" for k, v in versions.items())
    return fig, f"| | |\n|---|---|\n{rows}\n\nPackages: {pkgs}"


def gpu_test_files() -> list[str]:
    """The test files that mark tests `gpu` or `triton` (collecting only them keeps the stage
    short on a GPU host; on the CPU `gpu` ones are skipped and `triton` ones interpreted)."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(REPO_ROOT, "tests")):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "deploy"))
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                    if "mark.gpu" in text or "mark.triton" in text:
                        found.append(os.path.relpath(path, REPO_ROOT))
    return found


def stage_gpu_tests(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    files = gpu_test_files()
    proc = run_tree([sys.executable, "-m", "pytest", "-q", "-m", "gpu or triton", "-p",
                     "no:cacheprovider", *plan.gpu_test_args, *files],
                    timeout=max(budget.left - 5, 10))
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    with open(os.path.join(out, "gpu_tests.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m 'gpu or triton': {tail}")
    return ({"summary": tail, "returncode": proc.returncode, "files": files},
            f"`pytest -m 'gpu or triton'` over the {len(files)} files that mark tests so "
            f"(the Triton kernels compiled): {tail}")


def num_prompts(plan: Plan, budget: Budget, arms: int, startup_s: float) -> int:
    """As many prompts as the budget allows each arm: arrivals at the rate, plus the time the
    last request takes, plus starting the server (a rough guess, corrected by `min_prompts`)."""
    per_arm = budget.left * 0.6 / arms - startup_s - 15
    return int(max(plan.min_prompts, min(plan.max_prompts, per_arm * plan.request_rate)))


def experiment_prompts(plan: Plan, budget: Budget, arms: int) -> tuple[int, str]:
    """Prompts per arm, and why that many: the plan's count, or the budget's choice."""
    if plan.experiment_prompts:
        return plan.experiment_prompts, "as asked (--experiment-prompts)"
    n = num_prompts(plan, budget, arms, 60.0 if plan.device == "cuda" else 10.0)
    why = ("the budget's floor: the time left was short" if n == plan.min_prompts
           else "the plan's most" if n == plan.max_prompts
           else "as many as the time left allowed")
    return n, f"{why} ({plan.min_prompts}-{plan.max_prompts}; --experiment-prompts N fixes it)"


def named_arm(name: str) -> Arm:
    """The `--experiment-arms` name's arm (paced, over gRPC, as `bench ab` runs it)."""
    k, async_mode, prefill_phase = experiment_arm(name)
    return Arm(k, async_mode, prefill_phase=prefill_phase)


def stage_experiment(plan: Plan, out: str, budget: Budget,
                     profile: dict[str, Any]) -> tuple[dict[str, Any], str]:
    model, flags = serve_flags(plan, out)
    arms = {arm.name: arm for arm in map(named_arm, plan.experiment_arms)}
    n, why = experiment_prompts(plan, budget, len(arms))
    bench = BenchConfig(model=model, num_prompts=n, input_len=plan.input_len,
                        prefix_len=plan.prefix_len, output_len=plan.output_len,
                        request_rate=plan.request_rate, seed=0, warmup=4, progress=False)
    work = Workload.build(bench)
    say(f"experiment: {n} prompts per arm on {os.path.basename(model)} ({why})")
    keys = ("mean_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
            "p99_itl_ms",
            "output_throughput", "request_throughput", "completed", "duration",
            "device_idle_pct", "steady_idle_pct", "forward_ms_per_plan", "postproc_ms_per_plan")
    fig: dict[str, Any] = {}
    for name, arm in arms.items():
        say(f"experiment: {name}")
        hook = (profile_hook(plan, out, work, profile)
                if plan.profile and arm == Arm(8, True) else None)
        r = run_arm(model, arm, work, flags, hook)
        fig[name] = {k: r.get(k) for k in keys}
        with open(os.path.join(out, "experiment.json"), "w") as f:  # what a cut run leaves
            json.dump(fig, f, indent=2)
    fig.update(num_prompts=n, num_prompts_why=why, server_flags=flags)
    text = experiment_table(fig_arms(fig), with_seed=plan.experiment_model == "llama3-8b")
    mixed = prefill_ratios(fig_arms(fig))
    return fig, (f"{n} prompts per arm ({why}), {plan.request_rate:g} req/s, "
                 f"{plan.input_len}-token prompts ({plan.prefix_len} shared), "
                 f"{plan.output_len} output tokens; servers: `{' '.join(flags)}`.\n\n{text}"
                 f"\n\n{mixed}\n")


def fig_arms(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in fig.items() if isinstance(v, dict)}


def profile_hook(plan: Plan, out: str, work: Any,
                 profile: dict[str, Any]) -> Callable[[int], None]:
    """Record `--plans N` with torch.profiler on the async arm's server, under load."""

    def run(port: int) -> None:
        from tandem_serve.tandem import profile_report
        from tandem_serve.tandem.profile_cli import record

        started = time.monotonic()
        torch_trace = os.path.abspath(os.path.join(out, "torch_trace.json"))
        load = threading.Thread(target=lambda: work.run(port=port, model=work.bench.model),
                                daemon=True)
        load.start()
        try:
            rec = record("127.0.0.1", port, 120.0, plan.profile_plans, torch_trace)
        except Exception as exc:  # the experiment's figures stand without it
            profile["error"] = f"{type(exc).__name__}: {exc}"
            return
        finally:
            load.join()
        summary = profile_report.summarize(rec.profiles)
        with open(os.path.join(out, "trace.json"), "w") as f:
            json.dump(profile_report.chrome_trace(rec.profiles), f)
        profile.update(plans=rec.plans, torch_trace=rec.torch_trace,
                       torch_error=rec.torch_error, seconds=time.monotonic() - started,
                       summary=profile_report.format_summary(summary))

    return run


def stage_step(plan: Plan, out: str, budget: Budget,
               read_gbs: Callable[[str], float] = read_bandwidth_gbs
               ) -> tuple[dict[str, Any], str]:
    model, flags = experiment_model(plan, out)
    path = os.path.join(out, "step.json")
    args = ["bench", "step", "--model", model, "--device", plan.device, "--dtype", plan.dtype,
            "--batch-sizes", plan.step_batches, "--prompt-len", str(plan.step_prompt_len),
            "--steps", str(plan.step_steps), "--repeats", "1", "--json", path, *flags]
    proc = tandem(*args, timeout=budget.left - 10)
    if proc.returncode:
        raise RuntimeError(f"bench step failed: {proc.stderr[-800:]}")
    with open(path) as f:
        rows = json.load(f)["rows"]
    weight_bytes = decode_weight_bytes(model, plan.dtype)
    kv = kv_bytes_per_token(model, plan.dtype)
    bw = read_gbs(plan.device)
    # The timed steps attend to prompt + 1 .. prompt + steps tokens: their mean.
    context = plan.step_prompt_len + (plan.step_steps + 1) / 2
    for r in rows:
        r["bound_ms"] = ideal_step_ms(step_read_bytes(weight_bytes, kv, r["batch"], context),
                                      bw)
    fig = {"rows": rows, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv,
           "read_bandwidth_gbs": bw, "mean_context": context,
           "bandwidth_bound_ms": ideal_step_ms(weight_bytes, bw)}
    text = (f"Weights {weight_bytes / 2**30:.2f} GiB, K and V {kv / 1024:g} KiB per token; "
            f"read bandwidth {bw:.0f} GB/s (a reduction over a large tensor), so a step of "
            f"batch B at a mean context of {context:g} tokens reads its bytes in at least "
            "(weights + B x context x KV per token) / bandwidth.\n\n" + step_table(rows))
    return fig, text
