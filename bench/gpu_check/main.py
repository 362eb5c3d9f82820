"""`scripts/gpu-check`: one prepared run that proves the CUDA path and repeats the seed's
experiment, in the short window a GPU host is lent for.

Stages, in order, each written to the report as it finishes (`report.py`): environment → the
`gpu`-marked tests → greedy parity (float32 with CUDA graphs and eager, bfloat16 agreement)
→ the seed's experiment (a Llama-3-8B-shaped model with random bfloat16 weights made on the
device, async K=8 / sync K=8 / sync K=1 under `bench serve` at 10 req/s, 1,024-token prompts
with a 512-token shared prefix, 512 output tokens, and async K=8 with `--prefill-phase` for
mixed steps' ratios to a separate prefill forward) → a `tandem profile` of the async arm
with torch.profiler → the stall scenario (`tandem bench stall`: streams' worst inter-token
gap and long prompts' TTFT at two per-step budgets and `--prefill-phase`) → arrivals
(Poisson 1,024-token prompts, 128 out: mixed steps' ITL/TPOT p99 against
`--prefill-phase`) → decode ms/step
at batch 1/32/64 next to the memory-bandwidth bound and HF `generate()` → quantized weights
(ms/step and GiB per format next to bf16) → model families → the fp8 KV cache (greedy
agreement with a float32 cache; the seed workload's blocks and TPOT, fp8 next to auto) →
speculative decoding (`tandem bench spec --preset fast` on the copier, each method the tree
serves, against none).
A stage the remaining budget cannot hold is skipped and named; `--stages` runs only the named
ones (a short window spent on what it is for). `--cpu` runs the same flow on
the CPU with the tiny models and a small workload, which is how machines without a GPU prove
the script itself.

Modules: `plans.py` (the sizes), `models.py` (the checkpoints), `stages.py`, `parity.py`,
`features.py`, `stall.py`, `arrivals.py`, `quantized.py`, `families.py`, `kv_fp8.py` and
`spec.py` (the stages), `report.py` (what is written), `wheels.py` (what the host lacks).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from tandem_serve.bench.gpu_check.arrivals import stage_arrivals
from tandem_serve.bench.gpu_check.families import stage_families
from tandem_serve.bench.gpu_check.features import stage_features
from tandem_serve.bench.gpu_check.kv_fp8 import stage_kv_fp8
from tandem_serve.bench.gpu_check.parity import stage_parity
from tandem_serve.bench.gpu_check.plans import CPU_PLAN, GPU_PLAN, NEEDS, QUICK_PLAN
from tandem_serve.bench.gpu_check.quantized import stage_quantized
from tandem_serve.bench.gpu_check.report import Budget, Report, Stage, say
from tandem_serve.bench.gpu_check.spec import stage_spec
from tandem_serve.bench.gpu_check.stages import (
    stage_environment,
    stage_experiment,
    stage_gpu_tests,
    stage_step,
)
from tandem_serve.bench.gpu_check.stall import stage_stall

STAGES = ("environment", "gpu tests", "parity", "features", "experiment", "stall", "arrivals",
          "step", "quantized", "families", "kv fp8", "spec")


def run(out: str, budget_s: float, cpu: bool, quick: bool = False,
        only: tuple[str, ...] = ()) -> int:
    """Every stage in order (`only`: just those, in that order); 0 when none failed (skipped
    ones are named, not failures)."""
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
        ("stall", stage_stall), ("arrivals", stage_arrivals), ("step", stage_step),
        ("quantized", stage_quantized), ("families", stage_families), ("kv fp8", stage_kv_fp8),
        ("spec", stage_spec)]
    if only:  # the named stages first, in the order named; the others are reported skipped
        stages.sort(key=lambda s: only.index(s[0]) if s[0] in only else len(only))
    failed = 0
    for name, fn in stages:
        need = NEEDS[name][1 if cpu or quick else 0]
        if name in plan.skip or (only and name not in only):
            report.add(Stage(name, "skipped", error="not part of this flow" if name in plan.skip
                             else "not among --stages"))
            continue
        if not budget.allows(need):
            report.add(Stage(name, "skipped", error=f"budget: {budget.left:.0f} s left, needs "
                                                    f"~{need} s"))
            say(f"{name}: skipped ({budget.left:.0f} s left)")
            continue
        say(f"{name} ...")
        t0 = time.monotonic()
        try:
            fig, text = fn(plan, out, budget)
            report.add(Stage(name, "passed", time.monotonic() - t0, fig, text))
        except Exception as exc:  # the next stages still run: the window is short
            failed += 1
            report.add(Stage(name, "failed", time.monotonic() - t0,
                             error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            say(f"{name}: FAILED: {exc}")
        if name == "experiment":
            report.add(profile_stage(profile))
    say(f"wrote {os.path.join(out, 'report.md')} and results.json")
    return 1 if failed else 0


def profile_stage(profile: dict[str, Any]) -> Stage:
    if not profile:
        return Stage("profile", "skipped", error="the async arm did not run")
    if "error" in profile:
        return Stage("profile", "failed", error=profile["error"])
    fig = {k: v for k, v in profile.items() if k != "summary"}
    note = f"torch trace: {profile['torch_trace'] or profile['torch_error']}"
    return Stage("profile", "passed", profile.get("seconds", 0.0), fig,
                 f"{profile['plans']} plans recorded; {note}.\n\n```\n{profile['summary']}\n```")
