"""`scripts/gpu-check`: one prepared run that proves the CUDA path and repeats the seed's
experiment, in the short window a GPU host is lent for.

Stages, in order, each written to the report as it finishes (`report.py`): environment → the
`gpu`-marked tests → greedy parity (float32 with CUDA graphs and eager, bfloat16 agreement)
→ guided decoding, LoRA and TP against their references → the probe (decode ms/step of the
8B shape per attention backend, batch 1-128 x context 1k/4k, attention's share, the ratio
to the bandwidth bound: `probe.py`, `bound.py`) → the seed's experiment (a Llama-3-8B-shaped
model with random bfloat16 weights made on the device, sync K=1 / sync K=8 / async K=8 under
`bench serve` at 10 req/s, 1,024-token prompts with a 512-token shared prefix, 512 output
tokens, and async K=8 with `--prefill-phase` for mixed steps' ratios to a separate prefill
forward; `--experiment-arms` picks some) → a `tandem profile` of the async arm with
torch.profiler → the stall scenario (`tandem bench stall`: streams' worst inter-token gap
and long prompts' TTFT at two per-step budgets and `--prefill-phase`) → arrivals (Poisson
1,024-token prompts, 128 out: mixed steps' ITL/TPOT p99 against `--prefill-phase`) → decode
ms/step at batch 1/32/64 next to the memory-bandwidth bound and HF `generate()` → quantized
weights (ms/step and GiB per format next to bf16) → model families → the fp8 KV cache
(greedy agreement with a float32 cache; the seed workload's blocks and TPOT, fp8 next to
auto) → speculative decoding (`tandem bench spec --preset fast` on the copier, each method
the tree serves, against none).

A stage the remaining budget (or its cap in the plan) cannot hold is skipped and named;
`--stages` runs only the named ones, `--flow window` the one-window selection
(`plans.FLOWS`).  Every stage runs supervised (`supervise.py`): past its time its whole
process tree is ended and it is reported as timed out, and nothing it started outlives it.
`--cpu` runs the same flow on the CPU with the tiny models and a small workload, which is
how machines without a GPU prove the script itself.

Modules: `plans.py` (the sizes and flows), `models.py` (the checkpoints), `bound.py` (the
bandwidth bound), `supervise.py` (time limits and process trees), `stages.py`, `parity.py`,
`features.py`, `probe.py`, `stall.py`, `arrivals.py`, `quantized.py`, `families.py`,
`kv_fp8.py` and `spec.py` (the stages), `report.py` (what is written), `wheels.py` (what the
host lacks).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tandem_serve.bench.gpu_check.checks.arrivals import stage_arrivals
from tandem_serve.bench.gpu_check.checks.families import stage_families
from tandem_serve.bench.gpu_check.checks.features import stage_features
from tandem_serve.bench.gpu_check.checks.kv_fp8 import stage_kv_fp8
from tandem_serve.bench.gpu_check.checks.parity import stage_parity
from tandem_serve.bench.gpu_check.checks.probe import stage_probe
from tandem_serve.bench.gpu_check.checks.quantized import stage_quantized
from tandem_serve.bench.gpu_check.checks.spec import stage_spec
from tandem_serve.bench.gpu_check.checks.stall import stage_stall
from tandem_serve.bench.gpu_check.plans import (
    CPU_PLAN,
    FLOWS,
    GPU_PLAN,
    NEEDS,
    QUICK_PLAN,
    STAGES,
    Plan,
)
from tandem_serve.bench.gpu_check.report import Budget, Report, Stage, say
from tandem_serve.bench.gpu_check.stages import (
    stage_environment,
    stage_experiment,
    stage_gpu_tests,
    stage_step,
)
from tandem_serve.bench.gpu_check.supervise import StageSupervisor, StageTimeout

__all__ = ["FLOWS", "STAGES", "make_plan", "run", "run_stages"]

StageFn = Callable[[Plan, str, Budget], tuple[dict[str, Any], str]]
# The plan's fields the report's settings name (what the command line may change).
SETTINGS = ("experiment_prompts", "experiment_arms", "profile", "experiment_max_num_seqs",
            "probe_backends", "stage_caps")
# Seconds of the budget kept for the end: the last stage's guard (a few seconds past its
# own limit) and ending its processes (SIGTERM, then SIGKILL 10 s later).
END_MARGIN_S = 20.0
GUARD_GRACE_S = 5.0


def make_plan(cpu: bool, quick: bool = False, flow: str = "full",
              changes: dict[str, Any] | None = None) -> Plan:
    """The flow's plan (GPU, `--cpu` or the tests' `--quick` sizes) with `changes` (the
    command line's) on top."""
    base = QUICK_PLAN if quick else CPU_PLAN if cpu else GPU_PLAN
    return replace(FLOWS[flow].plan(base), **(changes or {}))


def run(out: str, budget_s: float, cpu: bool, quick: bool = False,
        only: tuple[str, ...] = (), flow: str = "full",
        changes: dict[str, Any] | None = None, started: float | None = None) -> int:
    """Every stage of `flow` in order (`only`: just those, in that order); 0 when none failed
    (skipped ones are named, not failures). `started`: the monotonic time the budget counts
    from (the command's start: installing wheels counts too)."""
    plan = make_plan(cpu, quick, flow, changes)
    profile: dict[str, Any] = {}
    fns: dict[str, StageFn] = {
        "environment": stage_environment, "gpu tests": stage_gpu_tests,
        "parity": stage_parity, "features": stage_features, "probe": stage_probe,
        "experiment": lambda p, o, b: stage_experiment(p, o, b, profile),
        "stall": stage_stall, "arrivals": stage_arrivals, "step": stage_step,
        "quantized": stage_quantized, "families": stage_families, "kv fp8": stage_kv_fp8,
        "spec": stage_spec}
    settings = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": budget_s,
                "device": plan.device, "plan": "quick" if quick else "cpu" if cpu else "gpu",
                "flow": f"{flow} ({', '.join(only or FLOWS[flow].stages)})",
                **{k: getattr(plan, k) for k in SETTINGS}}
    report = Report(out, "Tandem GPU check" + (" (--cpu)" if cpu else ""), settings)
    order = list(FLOWS[flow].stages) + [s for s in STAGES if s not in FLOWS[flow].stages]
    stages = [(name, fns[name]) for name in order]
    budget = Budget(budget_s) if started is None else Budget(budget_s, started)
    failed = run_stages(stages, plan, out, budget, report, only,
                        in_flow=set(FLOWS[flow].stages), flow=flow,
                        after={"experiment": lambda: report.add(profile_stage(profile, plan))})
    say(f"wrote {os.path.join(out, 'report.md')} and results.json")
    return 1 if failed else 0


def run_stages(stages: list[tuple[str, StageFn]], plan: Plan, out: str, budget: Budget,
               report: Report, only: tuple[str, ...] = (), in_flow: set[str] | None = None,
               flow: str = "full", after: dict[str, Callable[[], None]] | None = None,
               supervisor: StageSupervisor | None = None) -> int:
    """Run `stages` in order under `supervisor`, each within the budget left and its cap
    (`plan.stage_caps`); how many failed."""
    supervisor = supervisor or StageSupervisor()
    if only:  # the named stages first, in the order named; the others are reported skipped
        stages = sorted(stages, key=lambda s: only.index(s[0]) if s[0] in only else len(only))
    failed = 0
    for name, fn in stages:
        need = NEEDS.get(name, (0, 0))[0 if plan.device == "cuda" else 1]
        why = ("not part of this plan" if name in plan.skip
               else "not among --stages" if only and name not in only
               else f"not in the {flow} flow" if not only and in_flow is not None
               and name not in in_flow else "")
        if why:
            report.add(Stage(name, "skipped", error=why))
            continue
        allowed = budget.left - END_MARGIN_S
        cap = plan.stage_caps.get(name)
        if cap is not None:
            allowed = min(allowed, cap)
        if allowed < need:
            report.add(Stage(name, "skipped", error=f"budget: {budget.left:.0f} s left"
                             + (f" (its cap {cap:g} s)" if cap is not None else "")
                             + f", needs ~{need} s"))
            say(f"{name}: skipped ({budget.left:.0f} s left)")
            continue
        say(f"{name} ... ({allowed:.0f} s at most)")
        failed += run_one(name, fn, plan, out, allowed, report, supervisor)
        if after and name in after:
            after[name]()
    return failed


def run_one(name: str, fn: StageFn, plan: Plan, out: str, allowed: float, report: Report,
            supervisor: StageSupervisor) -> int:
    """One stage, supervised: 1 when it failed (or timed out), else 0."""
    t0 = time.monotonic()
    fig: dict[str, Any] = {}
    text, error = "", ""
    try:
        with supervisor.stage(allowed + GUARD_GRACE_S) as guard:
            fig, text = fn(plan, out, Budget(allowed))
    except StageTimeout:
        pass
    except Exception as exc:  # the next stages still run: the window is short
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    if guard.timed_out:
        error = (f"timed out after {guard.timeout_s:.0f} s; its processes were ended"
                 + (f" ({error})" if error else ""))
    if guard.left_behind:
        fig["processes_left"] = guard.left_behind
        text += (f"\n\nThe stage left {len(guard.left_behind)} process(es) running "
                 f"({', '.join(guard.left_behind)}); gpu-check ended them.")
    seconds = time.monotonic() - t0
    if error:
        report.add(Stage(name, "failed", seconds, fig, text, error=error))
        say(f"{name}: FAILED: {error}")
        return 1
    report.add(Stage(name, "passed", seconds, fig, text))
    return 0


def profile_stage(profile: dict[str, Any], plan: Plan) -> Stage:
    if not plan.profile:
        return Stage("profile", "skipped", error="off in this run (--no-profile, or the flow)")
    if not profile:
        return Stage("profile", "skipped", error="the async arm did not run")
    if "error" in profile:
        return Stage("profile", "failed", error=profile["error"])
    fig = {k: v for k, v in profile.items() if k != "summary"}
    note = f"torch trace: {profile['torch_trace'] or profile['torch_error']}"
    return Stage("profile", "passed", profile.get("seconds", 0.0), fig,
                 f"{profile['plans']} plans recorded; {note}.\n\n```\n{profile['summary']}\n```")
