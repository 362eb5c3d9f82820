"""`tandem bench lora`: what serving LoRA adapters costs next to the base model alone.

One server (K=8 async by default) with an adapter cache of `--adapters` synthetic adapters
(rank `--rank`, every linear layer), and the same seeded workload run in three arms,
alternately, `--repeats` times each: the base model alone, every request on one adapter,
and requests spread over every adapter (request i on adapter i mod n, as `bench serve
--adapters` does).  It prints median TPOT, ITL and output throughput per arm, and ratios to
the base arm taken within each repeat (then the median), and writes the figures as JSON.

The adapters are synthetic (`adapters.py`): random weights in PEFT's layout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from tandem_serve.bench.lora.adapters import write_adapters
from tandem_serve.bench.serve.workload import add_one_server_arguments, run_one_server_arms
from tandem_serve.harness.stats import median_result
from tandem_serve.harness.tables import paired_table

COLUMNS = [("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("mean_itl_ms", "ITL ms"),
           ("output_throughput", "out tok/s")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL", ""),
                   help="model folder (default: the embedded tiny model)")
    p.add_argument("--adapters", type=int, default=4, help="adapters the requests spread over")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    add_one_server_arguments(p, input_len=128)
    p.add_argument("--output-json", default="bench_lora.json")
    p.add_argument("--step", action="store_true",
                   help="instead of serving: decode ms/step in one process, arms alternating "
                        "(bench/step/lora.py), batch --max-concurrency")


def step_main(args: argparse.Namespace, model: str) -> int:
    from tandem_serve.bench.step.lora import step_table

    ids = [f"bench-{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as cache:
        write_adapters(cache, model, ids, args.rank)
        print(step_table(model, cache, ids, args.rank, batch=args.max_concurrency,
                         prompt_len=args.input_len, k=args.steps, repeats=args.repeats))
    return 0


def main(args: argparse.Namespace) -> int:
    model = args.model
    if not model:
        from tandem_serve.harness.tiny_model import ensure_default_model

        model = str(ensure_default_model())
    if args.step:
        return step_main(args, model)
    ids = [f"bench-{i}" for i in range(args.adapters)]
    arms: dict[str, dict[str, Any]] = {"base model": {"adapters": []},
                                       "1 adapter": {"adapters": ids[:1]},
                                       f"{args.adapters} adapters": {"adapters": ids}}

    def check(name: str, r: dict[str, Any]) -> None:
        if r["completed"] != args.num_prompts:
            errors = [e for e in r.get("errors", []) if e]
            raise SystemExit(f"tandem bench lora: {name}: {args.num_prompts - r['completed']} "
                             f"requests failed: {errors[:1]}")

    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as cache:
        write_adapters(cache, model, ids, args.rank)
        extra = ["--adapter-cache", cache, "--max-loras", str(max(args.adapters, 1)),
                 "--max-lora-rank", str(args.rank)]
        runs = run_one_server_arms("lora", model, args, extra, arms, check)
    print(paired_table(runs, "base model", COLUMNS))
    results = {name: median_result(rs) for name, rs in runs.items()}
    keep = [k for k, _ in COLUMNS] + ["completed", "median_tpot_ms", "p99_tpot_ms", "repeats"]
    with open(args.output_json, "w") as f:
        json.dump({n: {k: r.get(k) for k in keep} for n, r in results.items()}, f, indent=2)
    print(f"wrote {args.output_json}", file=sys.stderr)
    return 0
