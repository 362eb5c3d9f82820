"""`tandem bench guided`: what guided requests cost a served batch, per kind.

One server (K=8 async by default, on the fast preset unless `--model` says otherwise) with an
empty guided cache, and the same seeded workload run once unguided and once per kind with
`--guided-share` of its requests constrained (`bench serve --guided KIND`), the arms
alternating over `--repeats`.  It prints median TTFT, TPOT and throughput per arm with paired
ratios to the unguided arm, and per kind the first guided request's TTFT: every run makes its
constraint text unique, so that request waits for a cold compile (format=JSON has no such
variant: the server compiles it at start-up, and its first arm's warm-up waits for that).

What a guided request asks for is short (a phone number, a colour, a small record, a sum):
it ends when its constraint is complete, while the unguided ones run to `--output-len`, so
the guided rows share the batch for only part of a run.  `tandem bench step --guided`
measures a batch that keeps half its rows guided.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from tandem_serve.bench.serve import guided_load
from tandem_serve.bench.serve.workload import add_one_server_arguments, run_one_server_arms
from tandem_serve.harness.stats import median_result
from tandem_serve.harness.tables import paired_table

COLUMNS = [("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"),
           ("output_throughput", "out tok/s"),
           ("guided_first_ttft_ms", "first guided TTFT ms (cold compile)"),
           ("guided_mean_output_tokens", "guided output tokens")]
BASE = "unguided"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL", ""),
                   help="model folder (default: the embedded tiny model, fast preset)")
    p.add_argument("--kinds", default=",".join(guided_load.KINDS),
                   help=f"comma-separated, from {', '.join(guided_load.KINDS)}")
    p.add_argument("--guided-share", type=float, default=0.5,
                   help="share of each guided arm's requests that are constrained")
    add_one_server_arguments(p, input_len=64)
    p.add_argument("--output-json", default="bench_guided.json")


def check(name: str, result: dict[str, Any], expected: int) -> None:
    failed = max(expected - result["completed"], result.get("guided_failed", 0))
    if failed:
        errors = [e for e in result.get("errors", []) if e] or \
            [result.get("guided_first_error", "")]
        raise SystemExit(f"tandem bench guided: {name}: {failed} requests failed: {errors[:1]}")


def main(args: argparse.Namespace) -> int:
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in guided_load.KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown[0]!r}; choose from "
                         f"{', '.join(guided_load.KINDS)}")
    model = args.model
    if not model:
        from tandem_serve.harness.tiny_model import ensure_default_model

        model = str(ensure_default_model("fast"))
    arms: dict[str, dict[str, Any]] = {BASE: {"guided": ""}}
    arms.update({k: {"guided": k, "guided_share": args.guided_share} for k in kinds})
    with tempfile.TemporaryDirectory(prefix="tandem-bench-guided-") as cache:
        runs = run_one_server_arms(
            "guided", model, args, ["--guided-cache-dir", cache], arms,
            lambda name, r: check(name, r, args.num_prompts))
    print(f"K={args.steps} async, {args.num_prompts} requests x {args.output_len} tokens, "
          f"{args.max_concurrency} at a time; {args.guided_share:.0%} of a guided arm's "
          f"requests constrained; medians of {args.repeats} interleaved runs on one server")
    print(paired_table(runs, BASE, COLUMNS))
    results = {name: median_result(rs) for name, rs in runs.items()}
    for name in kinds:
        cold = [r["guided_first_ttft_ms"] for r in runs[name] if r.get("guided_first_ttft_ms")]
        if cold:
            results[name]["guided_first_ttft_ms_runs"] = cold
            results[name]["guided_first_ttft_ms"] = statistics.median(cold)
    keep = [k for k, _ in COLUMNS] + ["completed", "median_tpot_ms", "p99_tpot_ms", "repeats",
                                      "guided_first_ttft_ms_runs", "guided_median_ttft_ms"]
    with open(args.output_json, "w") as f:
        json.dump({n: {k: r.get(k) for k in keep} for n, r in results.items()}, f, indent=2)
    print(f"wrote {args.output_json}", file=sys.stderr)
    return 0
