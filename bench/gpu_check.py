"""`scripts/gpu-check`: one prepared run that proves the CUDA path and repeats the seed's
experiment, in the short window a GPU host is lent for.

Stages, in order, each written to the report as it finishes (`bench.gpu_check_report`):
environment → the `gpu`-marked tests → greedy parity (float32 with CUDA graphs and eager,
bfloat16 agreement) → the seed's experiment (a Llama-3-8B-shaped model with random bfloat16
weights made on the device, async K=8 / sync K=8 / sync K=1 under `bench serve` at 10 req/s,
1,024-token prompts with a 512-token shared prefix, 512 output tokens) → a `tandem profile`
of the async arm with torch.profiler → decode ms/step at batch 1/32/64 next to the
memory-bandwidth bound and HF `generate()`. A stage the remaining budget cannot hold is
skipped and named. `--cpu` runs the same flow on the CPU with the tiny models and a small
workload, which is how machines without a GPU prove the script itself.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

from tandem_serve.bench.gpu_check_report import Budget, Report, Stage, experiment_table, step_table
from tandem_serve.ipc.process import CLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
PARITY_PROMPTS = [("Once upon a time", 48), ("The quick brown fox jumps over", 32),
                  ("Tandem runs the model while", 40), ("1, 2, 3, 4,", 64)]


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the GPU flow, the `--cpu` flow, or the test's `--quick` one."""

    device: str
    dtype: str  # the experiment's and step stage's dtype
    experiment_model: str  # "llama3-8b" (dummy weights) or a tiny preset
    input_len: int
    prefix_len: int
    output_len: int
    request_rate: float
    max_prompts: int
    min_prompts: int
    step_batches: str
    step_prompt_len: int
    step_steps: int
    profile_plans: int
    parity_prompts: int
    server_args: tuple[str, ...] = ()
    parity_model: str = "default"
    skip: tuple[str, ...] = ()  # stages this plan leaves out


GPU_PLAN = Plan("cuda", "bfloat16", "llama3-8b", 1024, 512, 512, 10.0, 200, 20, "1,32,64",
                512, 32, 20, 4, ("--kv-cache-memory", "40", "--max-num-seqs", "128"))
CPU_PLAN = Plan("cpu", "float32", "default", 128, 64, 32, 8.0, 48, 8, "1,8,32", 128, 16, 10, 4)
QUICK_PLAN = replace(CPU_PLAN, experiment_model="fast", input_len=32, prefix_len=16,
                     output_len=8, request_rate=50.0,
                     max_prompts=4, min_prompts=4, step_batches="1", step_prompt_len=16,
                     step_steps=8, profile_plans=3, parity_prompts=1, parity_model="fast",
                     skip=("gpu tests", "features"))


def _say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def _tandem(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=max(timeout, 1.0))


# ------------------------------------------------------------------------ stages


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
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests"], cwd=ROOT, text=True,
                          capture_output=True, timeout=max(budget.left - 60, 30))
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    with open(os.path.join(out, "gpu_tests.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m gpu: {tail}")
    return {"summary": tail, "returncode": proc.returncode}, f"`pytest -m gpu`: {tail}"


def _hf_greedy(model: str, device: str, dtype: str,
               jobs: list[tuple[str, int]]) -> list[list[str]]:
    """HF generate()'s greedy tokens (as token strings) for each (prompt, n)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    hf.to(device)
    out: list[list[str]] = []
    for text, n in jobs:
        ids = tok(text, return_tensors="pt").input_ids.to(device)
        gen = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(list(tok.convert_ids_to_tokens(gen[0, ids.shape[1]:].tolist())))
    del hf
    return out


def _served_tokens(model: str, flags: list[str], jobs: list[tuple[str, int]]) -> list[list[str]]:
    from tandem_serve.bench.ab import Arm, arm_server
    from tandem_serve.rpc.client import GenerateOptions

    with arm_server(model, Arm(8, True), flags) as (_, client, _port, _):
        out = []
        for text, n in jobs:
            opts = GenerateOptions(max_new_tokens=n, min_new_tokens=n, generated_tokens=True)
            out.append([t.text for r in client.stream(text, opts) for t in r.tokens])
        return out


def _agreement(got: list[list[str]], want: list[list[str]]) -> tuple[int, float]:
    """Prompts whose tokens all match, and the share of tokens before the first mismatch."""
    exact = sum(g == w for g, w in zip(got, want, strict=True))
    prefix = 0
    for g, w in zip(got, want, strict=True):
        prefix += next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                       min(len(g), len(w)))
    return exact, prefix / max(sum(len(w) for w in want), 1)


def stage_parity(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    model = _tiny_model(out, plan.parity_model)
    jobs = PARITY_PROMPTS[:plan.parity_prompts]
    base = ["--device", plan.device]
    variants: list[tuple[str, str, list[str]]] = [("float32", "float32", [])]
    if plan.device == "cuda":
        variants += [("float32 --enforce-eager", "float32", ["--enforce-eager"]),
                     ("bfloat16", "bfloat16", [])]
    fig: dict[str, Any] = {}
    rows = ["| server | prompts equal to HF | tokens agreeing |", "|---|---:|---:|"]
    refs: dict[str, list[list[str]]] = {}
    for name, dtype, extra in variants:
        if dtype not in refs:
            refs[dtype] = _hf_greedy(model, plan.device, dtype, jobs)
        got = _served_tokens(model, [*base, "--dtype", dtype, *extra], jobs)
        exact, share = _agreement(got, refs[dtype])
        fig[name] = {"exact": exact, "prompts": len(jobs), "token_agreement": share}
        rows.append(f"| {name} | {exact}/{len(jobs)} | {100 * share:.1f}% |")
    fp32 = [v for k, v in fig.items() if k.startswith("float32")]
    if any(v["exact"] != v["prompts"] for v in fp32):
        raise RuntimeError("float32 greedy output differs from HF generate(): " + json.dumps(fig))
    return fig, "\n".join(rows)


def stage_features(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    from tandem_serve.bench.gpu_check_features import check_features

    return check_features(_tiny_model(out, "default"), plan.device, out)


def _tiny_model(out: str, preset: str) -> str:
    """The tiny model of `preset`, from the model cache (built there once)."""
    from tandem_serve.gpu_worker.tiny_model import ensure_default_model

    return str(ensure_default_model(preset, in_subprocess=True))


def _experiment_model(plan: Plan, out: str) -> tuple[str, list[str]]:
    """The experiment's model folder and the server flags it needs."""
    if plan.experiment_model != "llama3-8b":
        return _tiny_model(out, plan.experiment_model), []
    tiny = _tiny_model(out, "default")
    path = os.path.join(out, "models", "llama3-8b-shaped")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tiny):  # the tokenizer and generation config, not the weights
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(tiny, name), path)
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    config.update(LLAMA3_8B, torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path, ["--load-format", "dummy"]


def _num_prompts(plan: Plan, budget: Budget, arms: int, startup_s: float) -> int:
    """As many prompts as the budget allows each arm: arrivals at the rate, plus the time the
    last request takes, plus starting the server (a rough guess, corrected by `min_prompts`)."""
    per_arm = budget.left * 0.6 / arms - startup_s - 15
    return int(max(plan.min_prompts, min(plan.max_prompts, per_arm * plan.request_rate)))


def stage_experiment(plan: Plan, out: str, budget: Budget,
                     profile: dict[str, Any]) -> tuple[dict[str, Any], str]:
    from tandem_serve.bench.ab import Arm, Workload
    from tandem_serve.bench.serve import BenchConfig

    model, flags = _experiment_model(plan, out)
    flags = [*flags, "--device", plan.device, "--dtype", plan.dtype, *plan.server_args]
    n = _num_prompts(plan, budget, 3, 60.0 if plan.device == "cuda" else 10.0)
    bench = BenchConfig(model=model, num_prompts=n, input_len=plan.input_len,
                        prefix_len=plan.prefix_len, output_len=plan.output_len,
                        request_rate=plan.request_rate, seed=0, warmup=4, progress=False)
    work = Workload.build(bench)
    _say(f"experiment: {n} prompts per arm on {os.path.basename(model)}")
    arms = {"sync K=1": Arm(1, False), "sync K=8": Arm(8, False), "async K=8": Arm(8, True)}
    results: dict[str, dict[str, Any]] = {}
    for name, arm in arms.items():
        _say(f"experiment: {name}")
        hook = _profile_hook(plan, out, work, profile) if arm == Arm(8, True) else None
        results[name] = _run_arm(model, arm, work, flags, hook)
    keys = ("mean_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "output_throughput", "request_throughput", "completed", "duration",
            "device_idle_pct", "steady_idle_pct", "forward_ms_per_plan", "postproc_ms_per_plan")
    fig: dict[str, Any] = {name: {k: r.get(k) for k in keys} for name, r in results.items()}
    fig["num_prompts"] = n
    text = experiment_table(fig_arms(fig), with_seed=plan.experiment_model == "llama3-8b")
    return fig, f"{n} prompts per arm, {plan.request_rate:g} req/s, {plan.input_len}-token " \
                f"prompts ({plan.prefix_len} shared), {plan.output_len} output tokens.\n\n{text}"


def fig_arms(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in fig.items() if isinstance(v, dict)}


def _run_arm(model: str, arm: Any, work: Any, flags: list[str],
             after: Callable[[int], None] | None) -> dict[str, Any]:
    """bench ab's arm (fresh server, warm-up, engine counters), then `after(port)` on the
    same server while it still runs."""
    from tandem_serve.bench.ab import _counters, arm_server, beside_frontend, engine_figures

    with arm_server(model, arm, flags) as (proc, client, port, _):
        before: dict[str, Any] = {}

        def warmed() -> None:
            time.sleep(0.5)  # the scheduler reports counters every 0.2 s
            before.update(_counters(client))

        with beside_frontend(proc.pid):
            result = work.run(port=port, model=model, warmed=warmed)
        time.sleep(0.5)
        result.update(engine_figures(before, _counters(client)))
        if after is not None:
            after(port)
        return dict(result)


def _profile_hook(plan: Plan, out: str, work: Any,
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


def _bandwidth_gbs(device: str) -> float:
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
    model, flags = _experiment_model(plan, out)
    path = os.path.join(out, "step.json")
    args = ["bench", "step", "--model", model, "--device", plan.device, "--dtype", plan.dtype,
            "--batch-sizes", plan.step_batches, "--prompt-len", str(plan.step_prompt_len),
            "--steps", str(plan.step_steps), "--repeats", "1", "--json", path, *flags]
    proc = _tandem(*args, timeout=budget.left - 10)
    if proc.returncode:
        raise RuntimeError(f"bench step failed: {proc.stderr[-800:]}")
    with open(path) as f:
        rows = json.load(f)["rows"]
    weight_bytes = _weight_bytes(model, plan.dtype)
    bw = _bandwidth_gbs(plan.device)
    bound_ms = weight_bytes / (bw * 1e9 / 2) * 1e3  # the copy moved 2 bytes per byte read
    fig = {"rows": rows, "weight_bytes": weight_bytes, "read_bandwidth_gbs": bw / 2,
           "bandwidth_bound_ms": bound_ms}
    text = (f"Weights {weight_bytes / 2**30:.2f} GiB; measured read bandwidth "
            f"{bw / 2:.0f} GB/s, so one decode step reads them in at least {bound_ms:.3f} "
            f"ms.\n\n" + step_table(rows, bound_ms))
    return fig, text


def _weight_bytes(model: str, dtype: str) -> int:
    from tandem_serve.gpu_worker.models.config import ModelArgs

    with open(os.path.join(model, "config.json")) as f:
        a = ModelArgs.from_hf_config(json.load(f))
    h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
    per_layer = h * (a.num_heads + 2 * a.num_kv_heads) * d + a.num_heads * d * h + 3 * h * i
    # A decode step reads every layer and the LM head; the embedding is a gather of B rows.
    params = a.num_layers * per_layer + a.vocab_size * h
    return params * (4 if dtype == "float32" else 2)


# ------------------------------------------------------------------------ the run

# Rough seconds each stage needs at least, GPU and CPU; below that it is skipped and named.
NEEDS = {"environment": (5, 5), "gpu tests": (60, 30), "parity": (90, 40),
         "features": (60, 40), "experiment": (200, 60), "profile": (0, 0), "step": (60, 40)}


def run(out: str, budget_s: float, cpu: bool, quick: bool = False) -> int:
    """Every stage in order; 0 when none failed (skipped ones are named, not failures)."""
    plan = QUICK_PLAN if quick else CPU_PLAN if cpu else GPU_PLAN
    budget = Budget(budget_s)
    report = Report(out, "Tandem GPU check" + (" (--cpu)" if cpu else ""),
                    {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": budget_s,
                     "device": plan.device, "plan": "quick" if quick else
                     "cpu" if cpu else "gpu"})
    profile: dict[str, Any] = {}
    stages: list[tuple[str, Callable[..., tuple[dict[str, Any], str]]]] = [
        ("environment", stage_environment), ("gpu tests", stage_gpu_tests),
        ("parity", stage_parity), ("features", stage_features),
        ("experiment", lambda p, o, b: stage_experiment(p, o, b, profile)),
        ("step", stage_step)]
    failed = 0
    for name, fn in stages:
        need = NEEDS[name][1 if cpu or quick else 0]
        if name in plan.skip:
            report.add(Stage(name, "skipped", error="not part of this flow"))
            continue
        if not budget.allows(need):
            report.add(Stage(name, "skipped", error=f"budget: {budget.left:.0f} s left, needs "
                                                    f"~{need} s"))
            _say(f"{name}: skipped ({budget.left:.0f} s left)")
            continue
        _say(f"{name} ...")
        t0 = time.monotonic()
        try:
            fig, text = fn(plan, out, budget)
            report.add(Stage(name, "passed", time.monotonic() - t0, fig, text))
        except Exception as exc:  # the next stages still run: the window is short
            failed += 1
            report.add(Stage(name, "failed", time.monotonic() - t0,
                             error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            _say(f"{name}: FAILED: {exc}")
        if name == "experiment":
            report.add(_profile_stage(profile))
    _say(f"wrote {os.path.join(out, 'report.md')} and results.json")
    return 1 if failed else 0


def _profile_stage(profile: dict[str, Any]) -> Stage:
    if not profile:
        return Stage("profile", "skipped", error="the async arm did not run")
    if "error" in profile:
        return Stage("profile", "failed", error=profile["error"])
    fig = {k: v for k, v in profile.items() if k != "summary"}
    note = f"torch trace: {profile['torch_trace'] or profile['torch_error']}"
    return Stage("profile", "passed", profile.get("seconds", 0.0), fig,
                 f"{profile['plans']} plans recorded; {note}.\n\n```\n{profile['summary']}\n```")

