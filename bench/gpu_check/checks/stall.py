"""The stall stage of `scripts/gpu-check`: `tandem bench stall` on the experiment's model,
mixed steps at a sweep of per-step budgets against `--prefill-phase` (4 streams decode while
6 prompts of ~1,000 tokens arrive 1.2 s apart).  On the GPU its servers run side by side on
the one device, so each gets a small KV cache (the scenario needs ~11k tokens); on the CPU
it runs in-process on the worker's CPU time (`--cpu`: the tiny default model)."""
from __future__ import annotations

import json
import os
from typing import Any

from tandem_serve.bench.gpu_check.models import experiment_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget, say
from tandem_serve.bench.gpu_check.supervise import tandem

BASELINE = "prefill-phase"


def stall_command(plan: Plan, out: str, path: str) -> list[str]:
    model, flags = experiment_model(plan, out)
    server = [*flags, "--device", plan.device, "--dtype", plan.dtype,
              "--kv-cache-memory", plan.stall_kv_cache_memory]
    return ["bench", "stall", "--model", model, *plan.stall_args, "--json", path,
            *(f"--server-arg={a}" for a in server)]


def stage_stall(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    from tandem_serve.bench.stall.report import from_json, frontier

    path = os.path.join(out, "stall.json")
    args = stall_command(plan, out, path)
    say(f"stall: tandem bench stall {' '.join(plan.stall_args)} ...")
    proc = tandem(*args, timeout=budget.left - 10)
    if proc.returncode:
        raise RuntimeError(f"bench stall failed: {proc.stderr[-800:]}")
    with open(path) as f:
        results = from_json(json.load(f))
    mixed = [a for a in results if a != BASELINE]
    fig = {"frontier": frontier(results, mixed, BASELINE), "rounds": len(results[BASELINE])}
    return fig, f"`tandem {' '.join(args)}`\n\n{proc.stdout.strip()}"
