"""One seeded `bench serve` workload run many times: by every arm of an A/B on its own
server, or by arms that share one server (`bench lora`, `bench guided`), alternating."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.run import build_dataset, load_tokenizer, run_benchmark
from tandem_serve.harness.arms import Arm, arm_server, beside_frontend, rounds


@dataclasses.dataclass
class Workload:
    """One seeded dataset for every arm and peer, built before any clock starts."""

    bench: BenchConfig
    items: list[Any]
    warmup_items: list[Any]  # other prompts: a warm-up must not seed the prefix cache
    tokenizer: Any

    @classmethod
    def build(cls, bench: BenchConfig) -> Workload:
        tok = load_tokenizer(bench)
        warm = build_dataset(bench, tok, warmup=True) if bench.warmup else []
        return cls(bench, build_dataset(bench, tok), warm, tok)

    def run(self, **changes: Any) -> dict[str, Any]:
        """Warm the target up, then run the workload; `warmed` is called in between, so
        counters read there leave the warm-up out."""
        warmed = changes.pop("warmed", None)
        cfg = dataclasses.replace(self.bench, progress=False, warmup=0, **changes)
        if self.warmup_items:
            asyncio.run(run_benchmark(cfg, items=self.warmup_items, tokenizer=self.tokenizer))
        if warmed is not None:
            warmed()
        return asyncio.run(run_benchmark(cfg, items=self.items, tokenizer=self.tokenizer))


def add_one_server_arguments(p: argparse.ArgumentParser, input_len: int) -> None:
    """The workload and repeat flags of a benchmark whose arms share one server."""
    p.add_argument("--steps", type=int, default=8, help="K of the server")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the server (repeatable)")


def run_one_server_arms(label: str, model: str, args: argparse.Namespace, extra: list[str],
                        arms: dict[str, dict[str, Any]],
                        check: Callable[[str, dict[str, Any]], None]
                        ) -> dict[str, list[dict[str, Any]]]:
    """Every arm's workload (`arms`: name -> bench config changes) on one K=`args.steps`
    async server, alternating order over `args.repeats`; `check` refuses a failed run."""
    bench = BenchConfig(num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, max_concurrency=args.max_concurrency,
                        seed=args.seed, warmup=4, model=model)
    work = Workload.build(bench)
    runs: dict[str, list[dict[str, Any]]] = {}
    with arm_server(model, Arm(args.steps, True), [*extra, *args.server_arg]) as served:
        with beside_frontend(served.proc.pid):
            for rep, order in rounds(list(arms.items()), args.repeats):
                for name, changes in order:
                    r = work.run(port=served.port, model=model, **changes)
                    check(name, r)
                    runs.setdefault(name, []).append(r)
                    print(f"[bench {label}] {rep + 1}/{args.repeats} {name}: TPOT "
                          f"{r['mean_tpot_ms']:.2f} ms, {r['output_throughput']:.0f} tok/s",
                          file=sys.stderr, flush=True)
    return runs
