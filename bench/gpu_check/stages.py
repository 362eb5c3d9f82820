"""The stages of `scripts/gpu-check` beside parity and features: the environment, the
`gpu`-marked tests, the seed's experiment (with a `tandem profile` of its async arm) and
decode ms/step next to the memory-bandwidth bound. Each returns (figures, markdown)."""
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
from tandem_serve.bench.gpu_check.models import decode_weight_bytes, experiment_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget, experiment_table, say, step_table
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.harness.arms import Arm, run_arm
from tandem_serve.harness.processes import REPO_ROOT
from tandem_serve.ipc.process import CLI


def tandem(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=max(timeout, 1.0))


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


def stage_gpu_tests(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    # tests/deploy needs kubernetes-validate, which a GPU host lacks, and has no GPU test.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests", "--ignore=tests/deploy"],
                          cwd=REPO_ROOT, text=True, capture_output=True,
                          timeout=max(budget.left - 60, 30))
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    with open(os.path.join(out, "gpu_tests.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m gpu: {tail}")
    return {"summary": tail, "returncode": proc.returncode}, f"`pytest -m gpu`: {tail}"


def num_prompts(plan: Plan, budget: Budget, arms: int, startup_s: float) -> int:
    """As many prompts as the budget allows each arm: arrivals at the rate, plus the time the
    last request takes, plus starting the server (a rough guess, corrected by `min_prompts`)."""
    per_arm = budget.left * 0.6 / arms - startup_s - 15
    return int(max(plan.min_prompts, min(plan.max_prompts, per_arm * plan.request_rate)))


def stage_experiment(plan: Plan, out: str, budget: Budget,
                     profile: dict[str, Any]) -> tuple[dict[str, Any], str]:
    model, flags = experiment_model(plan, out)
    flags = [*flags, "--device", plan.device, "--dtype", plan.dtype, *plan.server_args]
    n = num_prompts(plan, budget, 4, 60.0 if plan.device == "cuda" else 10.0)
    bench = BenchConfig(model=model, num_prompts=n, input_len=plan.input_len,
                        prefix_len=plan.prefix_len, output_len=plan.output_len,
                        request_rate=plan.request_rate, seed=0, warmup=4, progress=False)
    work = Workload.build(bench)
    say(f"experiment: {n} prompts per arm on {os.path.basename(model)}")
    # The last arm: each plan's prefill in a forward of its own, the baseline of mixed steps.
    arms = {"sync K=1": Arm(1, False), "sync K=8": Arm(8, False), "async K=8": Arm(8, True),
            "async K=8 prefill-phase": Arm(8, True, prefill_phase=True)}
    results: dict[str, dict[str, Any]] = {}
    for name, arm in arms.items():
        say(f"experiment: {name}")
        hook = profile_hook(plan, out, work, profile) if arm == Arm(8, True) else None
        results[name] = run_arm(model, arm, work, flags, hook)
    keys = ("mean_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
            "p99_itl_ms",
            "output_throughput", "request_throughput", "completed", "duration",
            "device_idle_pct", "steady_idle_pct", "forward_ms_per_plan", "postproc_ms_per_plan")
    fig: dict[str, Any] = {name: {k: r.get(k) for k in keys} for name, r in results.items()}
    fig["num_prompts"] = n
    text = experiment_table(fig_arms(fig), with_seed=plan.experiment_model == "llama3-8b")
    mixed = prefill_ratios(fig_arms(fig))
    return fig, f"{n} prompts per arm, {plan.request_rate:g} req/s, {plan.input_len}-token " \
                f"prompts ({plan.prefix_len} shared), {plan.output_len} output tokens.\n\n{text}" \
                f"\n\n{mixed}\n"


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


def bandwidth_gbs(device: str) -> float:
    """Measured copy bandwidth (bytes read + written per second) of the device, in GB/s."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best / 1e9


def stage_step(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
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
    bw = bandwidth_gbs(plan.device)
    bound_ms = weight_bytes / (bw * 1e9 / 2) * 1e3  # the copy moved 2 bytes per byte read
    fig = {"rows": rows, "weight_bytes": weight_bytes, "read_bandwidth_gbs": bw / 2,
           "bandwidth_bound_ms": bound_ms}
    text = (f"Weights {weight_bytes / 2**30:.2f} GiB; measured read bandwidth "
            f"{bw / 2:.0f} GB/s, so one decode step reads them in at least {bound_ms:.3f} "
            f"ms.\n\n" + step_table(rows, bound_ms))
    return fig, text
