"""The fp8 KV cache stage of `scripts/gpu-check` (`--kv-cache-dtype fp8` next to `auto`).

* agreement: greedy tokens of a float32 server on an fp8 cache against the same server on a
  float32 cache (the tiny default model; 16 prompts x 64 tokens on the GPU): the share of
  positions whose token is equal, and the share before each prompt's first difference;
* the seed's workload (the experiment's model and flags) served async K=8 on each cache:
  the blocks the server allocated in the same `--kv-cache-memory` and the TPOT.

Where both are the same server (the `--cpu` flow: the experiment's model is the tiny one in
float32), each cache's server does both, the agreement after the workload: two servers, not
four.

Random weights make a hard case: their attention is nearly as sensitive to a rounded key as
it can be, so agreement here is a floor, not what a trained checkpoint shows.
"""
from __future__ import annotations

from typing import Any

from tandem_serve.bench.gpu_check.checks.parity import agreement, client_tokens, served_tokens
from tandem_serve.bench.gpu_check.models import serve_flags, tiny_model
from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget, say
from tandem_serve.bench.gpu_check.stages import num_prompts
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.harness.arms import Arm, run_arm

KV_DTYPES = ("auto", "fp8")
AGREEMENT_PROMPTS = [
    "Once upon a time", "The quick brown fox jumps over", "Tandem runs the model while",
    "1, 2, 3, 4,", "In the beginning the universe was", "def fibonacci(n):",
    "The capital of France is", "Dear colleagues, I am writing to", "Water boils at",
    "SELECT name FROM users WHERE", "The three laws of motion are", "Roses are red,",
    "Step one: preheat the oven to", "import numpy as np\n", "Q: What is a prime number?\nA:",
    "The meeting was moved to Thursday because"]


def position_agreement(got: list[list[str]], want: list[list[str]]) -> float:
    """The share of positions (over `want`'s tokens) where both runs chose the same token."""
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w,
                                                                              strict=False))
    return same / max(sum(len(w) for w in want), 1)


def agreement_figures(plan: Plan, got: list[list[str]], ref: list[list[str]]
                      ) -> dict[str, Any]:
    exact, prefix = agreement(got, ref)
    return {"prompts": len(ref), "tokens": plan.kv_tokens, "exact_prompts": exact,
            "position_agreement": position_agreement(got, ref), "prefix_agreement": prefix}


def tokens_at(port: int, jobs: list[tuple[str, int]]) -> list[list[str]]:
    from tandem_serve.rpc.client import TandemClient

    client = TandemClient(f"127.0.0.1:{port}")
    try:
        return client_tokens(client, jobs)
    finally:
        client.close()


def stage_kv_fp8(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    fig: dict[str, Any] = {}
    model, flags = serve_flags(plan, out)
    if "--kv-cache-memory" not in flags:  # the default sizes by sequences, not by memory
        flags += ["--kv-cache-memory", "0.25"]
    tiny = tiny_model(out, plan.parity_model)
    jobs = [(p, plan.kv_tokens) for p in AGREEMENT_PROMPTS[:plan.kv_prompts]]
    shared = tiny == model and plan.dtype == "float32"
    tokens: dict[str, list[list[str]]] = {}
    if not shared:
        say("kv fp8: greedy agreement with a float32 cache")
        base = ["--device", plan.device, "--dtype", "float32"]
        for kv in KV_DTYPES:
            tokens[kv] = served_tokens(tiny, [*base, "--kv-cache-dtype", kv], jobs)
    n = num_prompts(plan, budget, len(KV_DTYPES), 60.0 if plan.device == "cuda" else 10.0)
    work = Workload.build(BenchConfig(
        model=model, num_prompts=n, input_len=plan.input_len, prefix_len=plan.prefix_len,
        output_len=plan.output_len, request_rate=plan.request_rate, seed=0, warmup=4,
        progress=False))
    for kv in KV_DTYPES:
        say(f"kv fp8: the seed workload, --kv-cache-dtype {kv}")
        blocks: dict[str, int] = {}

        def read_blocks(port: int, into: dict[str, int] = blocks, kv: str = kv) -> None:
            into["n"] = total_blocks(port)
            if shared:
                say(f"kv fp8: greedy agreement, --kv-cache-dtype {kv}")
                tokens[kv] = tokens_at(port, jobs)

        result = run_arm(model, Arm(8, True), work, [*flags, "--kv-cache-dtype", kv],
                         read_blocks)
        fig[kv] = {"num_kv_blocks": blocks["n"], "mean_tpot_ms": result["mean_tpot_ms"],
                   "completed": result["completed"],
                   "output_throughput": result["output_throughput"]}
    fig["num_prompts"] = n
    fig["agreement"] = agreement_figures(plan, tokens["fp8"], tokens["auto"])
    fig["shared_servers"] = shared
    return fig, kv_table(fig)


def total_blocks(port: int) -> int:
    from tandem_serve.rpc.client import TandemClient

    client = TandemClient(f"127.0.0.1:{port}")
    try:
        return int(client.stats().num_total_blocks)
    finally:
        client.close()


def kv_table(fig: dict[str, Any]) -> str:
    a = fig["agreement"]
    rows = [f"Greedy agreement, fp8 against a float32 cache ({a['prompts']} prompts x "
            f"{a['tokens']} tokens, float32 model): {100 * a['position_agreement']:.1f}% of "
            f"positions, {100 * a['prefix_agreement']:.1f}% before the first difference, "
            f"{a['exact_prompts']}/{a['prompts']} prompts identical.", "",
            f"The seed workload, async K=8, {fig['num_prompts']} prompts:", "",
            "| --kv-cache-dtype | KV blocks | mean TPOT ms | output tok/s |",
            "|---|---:|---:|---:|"]
    for kv in KV_DTYPES:
        r = fig[kv]
        rows.append(f"| {kv} | {r['num_kv_blocks']} | {r['mean_tpot_ms']:.2f} | "
                    f"{r['output_throughput']:.0f} |")
    auto, fp8 = fig["auto"], fig["fp8"]
    rows += ["", f"fp8 / auto: {fp8['num_kv_blocks'] / auto['num_kv_blocks']:.2f}x the blocks, "
                 f"{fp8['mean_tpot_ms'] / auto['mean_tpot_ms']:.2f}x the TPOT."]
    return "\n".join(rows)
