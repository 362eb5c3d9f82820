"""`tandem bench offload`: the host KV tier (`--kv-offloading-size`) against the device
cache alone, each arm on a fresh server with the same small device cache and workload.

Two workloads per arm:

* re-send: a long prompt, then another that evicts it from the device cache, then the first
  again, one at a time; the third request's TTFT is what the tier saves (a recompute of
  the prompt without it, a copy back with it);
* multi-turn: `bench serve --dataset multi-turn` conversations whose histories together
  outgrow the device cache, round-robin, so each turn finds its conversation evicted;
  TTFT p50 and throughput.

It prints one table (and the ratios on/off) and writes the figures as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from typing import Any

from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.datasets import (
    BenchItem,
    dataset_rng,
    multi_turn_dataset,
    random_dataset,
)
from tandem_serve.bench.serve.run import load_tokenizer, run_benchmark
from tandem_serve.harness.server import Served, serving

ARMS: tuple[tuple[str, list[str]], ...] = (
    ("device cache only", []), ("with host tier", ["--kv-offloading-size"]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL", ""), required=False,
                   help="model folder (e.g. `tandem make-tiny-model DIR`)")
    p.add_argument("--num-kv-blocks", type=int, default=128, help="the device cache, both arms")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-offloading-size", default="0.05", metavar="GIB",
                   help="the host tier of the second arm")
    p.add_argument("--resend-len", type=int, default=1700,
                   help="re-send: the prompt's tokens (the evicting one has 8%% more)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=600, help="each conversation's opening")
    p.add_argument("--input-len", type=int, default=200, help="tokens each turn adds")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_offload.json")


def _run(served: Served, model: str, items: list[BenchItem], concurrency: int,
         tokenizer: Any) -> dict[str, Any]:
    config = BenchConfig(backend="tandem", port=served.port, model=model,
                         max_concurrency=concurrency, progress=False)
    return asyncio.run(run_benchmark(config, items=items, tokenizer=tokenizer))


def _arm(args: argparse.Namespace, flags: list[str], resend: list[BenchItem],
         turns: list[BenchItem], tokenizer: Any) -> dict[str, float]:
    server_flags = ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size",
                    str(args.block_size), *flags]
    with serving(args.model, server_flags, quiet=True) as served:
        again = _run(served, args.model, resend, 1, tokenizer)
        conv = _run(served, args.model, turns, args.max_concurrency, tokenizer)
    assert again["completed"] == len(resend) and conv["completed"] == len(turns), (
        "requests failed", again["errors"], conv["errors"])
    return {"resend_ttft_ms": 1000 * again["ttfts"][2],
            "first_ttft_ms": 1000 * again["ttfts"][0],
            "p50_ttft_ms": conv["median_ttft_ms"],
            "request_throughput": conv["request_throughput"],
            "output_throughput": conv["output_throughput"]}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(row) + " |" for row in lines)


def main(args: argparse.Namespace) -> int:
    if not args.model:
        raise SystemExit("tandem bench offload: --model DIR is required")
    tokenizer = load_tokenizer(BenchConfig(model=args.model))
    rng = dataset_rng(args.seed)
    a = random_dataset(tokenizer, 1, args.resend_len, 8, rng=rng)[0]
    b = random_dataset(tokenizer, 1, args.resend_len * 27 // 25, 8, rng=rng)[0]
    resend = [a, dataclasses.replace(b, index=1), dataclasses.replace(a, index=2)]
    turns = multi_turn_dataset(tokenizer, args.conversations * args.turns, args.prefix_len,
                               args.input_len, args.output_len, args.turns, rng)
    history = max(item.prompt_len for item in turns) * args.conversations
    cache = args.num_kv_blocks * args.block_size
    print(f"device cache {cache} tokens; re-send {a.prompt_len} then {b.prompt_len} tokens; "
          f"{args.conversations} conversations x {args.turns} turns, {history} tokens of "
          f"history at the last turn\n")
    figures = {}
    for name, flags in ARMS:
        extra = [*flags, args.kv_offloading_size] if flags else []
        figures[name] = _arm(args, extra, resend, turns, tokenizer)
    off, on = (figures[name] for name, _ in ARMS)
    rows = [[name, f"{f['first_ttft_ms']:.0f}", f"{f['resend_ttft_ms']:.0f}",
             f"{f['p50_ttft_ms']:.0f}", f"{f['request_throughput']:.2f}",
             f"{f['output_throughput']:.1f}"] for name, f in figures.items()]
    rows.append(["on / off", "", f"{on['resend_ttft_ms'] / off['resend_ttft_ms']:.2f}x",
                 f"{on['p50_ttft_ms'] / off['p50_ttft_ms']:.2f}x",
                 f"{on['request_throughput'] / off['request_throughput']:.2f}x",
                 f"{on['output_throughput'] / off['output_throughput']:.2f}x"])
    print(_table(["arm", "first send TTFT ms", "re-send TTFT ms",
                          "multi-turn TTFT p50 ms", "multi-turn req/s",
                          "multi-turn out tok/s"], rows))
    with open(args.output_json, "w", encoding="utf-8") as f:
        json.dump(figures, f, indent=1)
    return 0
