"""`tandem bench ab`: the sync/async × K table, each arm on a fresh server, same workload.

For every arm (K ∈ --steps × {sync, async}) it starts `tandem serve` on the same model,
runs the same seeded `bench serve` workload against it, and reads the engine's counters
before and after (admin Stats): device idle share (time the gpu worker waited for a plan
over wall time), mean forward time per plan and mean postprocessing time per plan.  It
writes a markdown table with ratios to sync K=1, a JSON file and a PNG chart.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from rpc.bench_serve import BenchConfig, run_benchmark
from rpc.client import TandemClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Arm:
    steps: int
    async_mode: bool

    @property
    def name(self) -> str:
        return f"{'async' if self.async_mode else 'sync'} K={self.steps}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, arm: Arm, extra: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rpc.cli", "serve", "--model", model, "--port", str(port),
           "--num-scheduler-steps", str(arm.steps),
           "--async-postproc" if arm.async_mode else "--no-async-postproc",
           "--log-level", "WARNING", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)


def wait_ready(client: TandemClient, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if client.is_serving():
            return
        time.sleep(0.2)
    raise TimeoutError("server did not become ready")


def _counters(client: TandemClient) -> dict[str, float]:
    s = client.stats()
    return {f.name: float(getattr(s, f.name)) for f in s.DESCRIPTOR.fields}


def engine_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Device idle share and per-plan times from two snapshots of the engine's counters."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    plans = max(d.get("num_plans", 0.0), 1.0)
    wall = max(d.get("uptime_s", 0.0), 1e-9)
    return {
        "device_idle_pct": 100.0 * max(0.0, 1.0 - d.get("worker_busy_s", 0.0) / wall),
        "forward_ms_per_plan": 1e3 * d.get("forward_s", 0.0) / plans,
        "postproc_ms_per_plan": 1e3 * d.get("postproc_busy_s", 0.0) / plans,
        "plans": d.get("num_plans", 0.0),
        "wasted_tokens": d.get("tokens_after_finish", 0.0),
        "delivered_tokens": d.get("tokens_delivered", 0.0),
    }


def run_arm(model: str, arm: Arm, bench: BenchConfig, extra: list[str]) -> dict[str, Any]:
    port = _free_port()
    proc = start_server(model, arm, extra, port)
    client = TandemClient(f"127.0.0.1:{port}")
    try:
        wait_ready(client, proc)
        cfg = dataclasses.replace(bench, port=port, model=model, progress=False)
        before = _counters(client)
        result = asyncio.run(run_benchmark(cfg))
        time.sleep(0.5)  # the scheduler reports counters every 0.2 s
        result.update(engine_figures(before, _counters(client)))
        return result
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


COLUMNS = [("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("mean_itl_ms", "ITL ms"),
           ("output_throughput", "out tok/s"), ("device_idle_pct", "device idle %"),
           ("forward_ms_per_plan", "forward ms/plan"),
           ("postproc_ms_per_plan", "postproc ms/plan")]


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("sync K=1")
    head = "| arm | " + " | ".join(c for _, c in COLUMNS) + " | TPOT vs sync K=1 | " \
        "throughput vs sync K=1 |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for name, r in results.items():
        cells = [f"{r.get(k, float('nan')):.2f}" for k, _ in COLUMNS]
        tpot = r["mean_tpot_ms"] / base["mean_tpot_ms"] if base else float("nan")
        thr = r["output_throughput"] / base["output_throughput"] if base else float("nan")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tpot:.2f}× | {thr:.2f}× |")
    return "\n".join(lines)


def chart(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, label) in zip(axes, [("mean_tpot_ms", "mean TPOT (ms)"),
                                       ("output_throughput", "output tok/s"),
                                       ("device_idle_pct", "device idle (% of wall)")]):
        values = [results[n].get(key, 0.0) for n in names]
        colors = ["#1f77b4" if "async" in n else "#ff7f0e" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (e.g. a make-tiny-model one)")
    p.add_argument("--steps", default="1,8", help="comma-separated K values")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--logprobs", type=int, default=None,
                   help="ask top-N token detail (more postprocessing per token)")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every server (repeatable)")
    p.add_argument("--output-json", default="bench_ab.json")
    p.add_argument("--png", default="bench_ab.png")
    p.add_argument("--title", default="")


def main(args: argparse.Namespace) -> int:
    bench = BenchConfig(num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, request_rate=args.request_rate,
                        max_concurrency=args.max_concurrency, logprobs=args.logprobs,
                        stop=list(args.stop), seed=args.seed, warmup=4)
    arms = [Arm(int(k), a) for k in args.steps.split(",") for a in (False, True)]
    results: dict[str, dict[str, Any]] = {}
    for i, arm in enumerate(arms, 1):
        print(f"[bench ab] {i}/{len(arms)}: {arm.name} ...", file=sys.stderr, flush=True)
        r = run_arm(args.model, arm, bench, list(args.server_arg))
        results[arm.name] = r
        print(f"[bench ab]   TPOT {r['mean_tpot_ms']:.2f} ms, {r['output_throughput']:.0f} "
              f"tok/s, device idle {r['device_idle_pct']:.1f}%", file=sys.stderr, flush=True)
    text = table(results)
    print(text)
    keep = [k for k, _ in COLUMNS] + ["completed", "median_tpot_ms", "p99_tpot_ms",
                                      "median_ttft_ms", "p99_itl_ms", "plans",
                                      "wasted_tokens", "delivered_tokens"]
    with open(args.output_json, "w") as f:
        json.dump({n: {k: r.get(k) for k in keep} for n, r in results.items()}, f, indent=2)
    chart(results, args.png, args.title or f"Tandem A/B on {os.path.basename(args.model)}")
    print(f"wrote {args.output_json} and {args.png}", file=sys.stderr)
    return 0
