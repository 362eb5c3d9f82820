"""The arrivals stage of `scripts/gpu-check`: issue R's arrival workload on the experiment's
model and servers (Poisson arrivals of 1,024-token prompts, 128 output tokens; the `--cpu`
flow's are shorter), async K=8 with mixed
steps against the same server with `--prefill-phase`, each arm on a fresh server, arms
alternating over the plan's repeats; per arm the medians over repeats, then mixed steps'
ITL/TPOT p50 and p99, TTFT and throughput over the baseline's."""
from __future__ import annotations

import statistics
from typing import Any

from tandem_serve.bench.ab.tables import prefill_ratios
from tandem_serve.bench.gpu_check.models import serve_flags
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget, say
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.harness.arms import Arm, run_arm

ARMS = (Arm(8, True), Arm(8, True, prefill_phase=True))
KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "output_throughput", "completed", "duration")


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in KEYS
            if all(r.get(k) is not None for r in runs)}


def stage_arrivals(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    model, flags = serve_flags(plan, out)
    bench = BenchConfig(model=model, num_prompts=plan.arrival_prompts,
                        input_len=plan.arrival_input_len, output_len=plan.arrival_output_len,
                        request_rate=plan.arrival_rate, seed=0, warmup=4, progress=False)
    work = Workload.build(bench)
    runs: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in ARMS}
    for repeat in range(plan.arrival_repeats):
        for arm in ARMS:
            say(f"arrivals: {arm.name}, run {repeat + 1}")
            runs[arm.name].append(run_arm(model, arm, work, flags))
    fig: dict[str, Any] = {name: medians(r) for name, r in runs.items()}
    ratios = prefill_ratios(fig)
    rows = [f"| {name} | {f['mean_ttft_ms']:.1f} | {f['median_tpot_ms']:.2f} / "
            f"{f['p99_tpot_ms']:.2f} | {f['median_itl_ms']:.2f} / {f['p99_itl_ms']:.2f} | "
            f"{f['output_throughput']:.1f} |" for name, f in fig.items()]
    fig.update(num_prompts=plan.arrival_prompts, request_rate=plan.arrival_rate,
               repeats=plan.arrival_repeats, server_flags=flags)
    return fig, (f"{plan.arrival_prompts} prompts of {plan.arrival_input_len:,} tokens at "
                 f"{plan.arrival_rate:g} req/s (Poisson), {plan.arrival_output_len} output "
                 f"tokens, medians of {plan.arrival_repeats} "
                 "run(s) per arm.\n\n| arm | TTFT ms | TPOT ms p50 / p99 | ITL ms p50 / p99 | "
                 "out tok/s |\n|---|---|---|---|---|\n" + "\n".join(rows) + f"\n\n{ratios}\n")
