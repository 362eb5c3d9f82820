"""`tandem bench ab`: the sync/async × K table, each arm on a fresh server, same workload.

For every arm (K ∈ --steps × {sync, async}) it starts `tandem serve` on the same model,
runs the same seeded `bench serve` workload against it, and reads the engine's counters
before and after (admin Stats): device idle share (time the gpu worker waited for a plan)
over the whole run and in steady decode (plans without prefill), mean forward time per
plan and mean postprocessing time per plan, plus the CPU seconds each process used.
`--http` runs each async arm a second time over the OpenAI-compatible HTTP API (the
`openai-completions` backend) beside gRPC, for the HTTP / gRPC throughput ratio.
`--peers` runs the same workload against `transformers serve --continuous-batching` and
static-batch `generate()` in the same invocation; with transformers serve in it, Tandem's
largest-K async arm also runs over HTTP, so both servers are driven through the same HTTP
client.  It writes a markdown table with ratios to sync K=1, a JSON file and a PNG chart.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from tandem_serve.bench.ab.peers import PEERS, run_peer
from tandem_serve.bench.ab.tables import (
    COLUMNS,
    PEER_NAMES,
    chart,
    cpu_table,
    http_ratios,
    peer_ratios,
    prefill_ratios,
    table,
)
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.harness.arms import Arm, rounds, run_arm
from tandem_serve.harness.stats import median_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (e.g. a make-tiny-model one)")
    p.add_argument("--steps", default="1,8", help="comma-separated K values")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn from [len·(1-r), len·(1+r)]; 0: all equal")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--logprobs", type=int, default=None,
                   help="ask top-N token detail (more postprocessing per token)")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per arm, interleaved; the table shows per-figure medians")
    p.add_argument("--peers", default="",
                   help=f"comma-separated, from {', '.join(PEERS)}: the same workload "
                        "against them, in this run (needs the bench extra)")
    p.add_argument("--http", action="store_true",
                   help="also run every async arm over the OpenAI-compatible HTTP API "
                        "(HTTP / gRPC ratios)")
    p.add_argument("--unpaced", action="store_true",
                   help="also run async arms with --no-pace-plans (plan n+1 built as soon as "
                        "plan n is sent), for K > 1")
    p.add_argument("--prefill-phase", action="store_true",
                   help="also run every arm with --prefill-phase (each plan's prefill in a "
                        "forward of its own), for mixed steps' ratios to it")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every server (repeatable)")
    p.add_argument("--output-json", default="bench_ab.json")
    p.add_argument("--png", default="bench_ab.png")
    p.add_argument("--title", default="")


def engine_arms(steps: str, unpaced: bool, http: bool = False,
                peers: tuple[str, ...] = (), prefill_phase: bool = False) -> list[Arm]:
    """sync and async for each K; with `unpaced`, async --no-pace-plans too where K > 1 (a
    one-step plan asks for the next one at its start either way); with `http`, each async
    arm over HTTP too, and with transformers serve among the peers at least the largest-K
    async arm, so that peer is compared through the same HTTP client; with
    `prefill_phase`, each sync and paced async arm's --prefill-phase twin."""
    kinds = [(False, True), (True, True), (True, False)]
    ks = [int(k) for k in steps.split(",")]
    arms = [Arm(k, a, paced) for k in ks for a, paced in kinds
            if paced or (unpaced and k > 1)]
    twins = [dataclasses.replace(a, prefill_phase=True) for a in arms if a.paced] \
        if prefill_phase else []
    over_http = ks if http else [max(ks)] if "transformers-serve" in peers else []
    return arms + twins + [Arm(k, True, True, http=True) for k in over_http]


def main(args: argparse.Namespace) -> int:
    bench = BenchConfig(num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio,
                        request_rate=args.request_rate,
                        max_concurrency=args.max_concurrency, logprobs=args.logprobs,
                        stop=list(args.stop), seed=args.seed, warmup=4, model=args.model)
    work = Workload.build(bench)
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"--peers: unknown peer {p!r}; choose from {', '.join(PEERS)}")
    arms: list[Arm | str] = [*engine_arms(args.steps, args.unpaced, args.http, tuple(peers),
                                          args.prefill_phase), *peers]
    runs: dict[str, list[dict[str, Any]]] = {}
    total = len(arms) * args.repeats
    n = 0
    for _, order in rounds(arms, args.repeats):
        for arm in order:
            n += 1
            name = arm.name if isinstance(arm, Arm) else PEER_NAMES[arm]
            print(f"[bench ab] {n}/{total}: {name} ...", file=sys.stderr, flush=True)
            if isinstance(arm, Arm):
                r = run_arm(args.model, arm, work, list(args.server_arg))
            else:
                r = run_peer(arm, args.model, work)
            runs.setdefault(name, []).append(r)
            idle = r.get("steady_idle_pct")
            print(f"[bench ab]   TPOT {r['mean_tpot_ms']:.2f} ms, {r['output_throughput']:.0f} "
                  f"tok/s" + (f", idle in steady decode {idle:.1f}%" if idle is not None
                              else ""), file=sys.stderr, flush=True)
    results = {name: median_result(rs) for name, rs in runs.items()}
    print(table(results))
    print()
    print(f"CPU seconds per process ({os.cpu_count()} cores = {os.cpu_count()} CPU s per s of "
          "wall time):")
    print(cpu_table(results))
    for ratios in (http_ratios(results), peer_ratios(results), prefill_ratios(results)):
        if ratios:
            print()
            print(ratios)
    keep = [k for k, _ in COLUMNS] + ["completed", "duration", "median_tpot_ms", "p99_tpot_ms",
                                      "median_ttft_ms", "median_itl_ms", "p99_itl_ms", "plans",
                                      "wasted_tokens", "delivered_tokens", "cpu_s", "repeats"]
    with open(args.output_json, "w") as f:
        json.dump({n: {k: r.get(k) for k in keep} for n, r in results.items()}, f, indent=2)
    chart(results, args.png, args.title or f"Tandem A/B on {os.path.basename(args.model)}")
    print(f"wrote {args.output_json} and {args.png}", file=sys.stderr)
    return 0
