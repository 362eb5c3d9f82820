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
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from tandem_serve.bench.ab_tables import (
    COLUMNS,
    PEER_NAMES,
    chart,
    cpu_table,
    http_ratios,
    median_result,
    peer_ratios,
    table,
)
from tandem_serve.bench.serve import BenchConfig, run_benchmark
from tandem_serve.bench.soak import free_port, role_of, tree_pids
from tandem_serve.ipc.process import CLI
from tandem_serve.rpc.client import TandemClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Arm:
    steps: int
    async_mode: bool
    paced: bool = True  # async only: --pace-plans (the default) or --no-pace-plans
    http: bool = False  # driven over the OpenAI-compatible HTTP API instead of gRPC

    @property
    def name(self) -> str:
        mode = "sync" if not self.async_mode else "async" if self.paced else "async unpaced"
        return f"{mode} K={self.steps}" + (" HTTP" if self.http else "")


def start_server(model: str, arm: Arm, extra: list[str], port: int,
                 http_port: int = 0) -> subprocess.Popen:
    cmd = [*CLI, "serve", "--model", model, "--port", str(port),
           "--http-port", str(http_port), "--num-scheduler-steps", str(arm.steps),
           "--async-postproc" if arm.async_mode else "--no-async-postproc",
           "--pace-plans" if arm.paced else "--no-pace-plans",
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
    values = {f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


def engine_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Device idle share and per-plan times from two snapshots of the engine's counters."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    plans = max(d.get("num_plans", 0.0), 1.0)
    wall = max(d.get("uptime_s", 0.0), 1e-9)
    steady = d.get("steady_busy_s", 0.0) + d.get("steady_idle_s", 0.0)
    return {
        "device_idle_pct": 100.0 * max(0.0, 1.0 - d.get("worker_busy_s", 0.0) / wall),
        "steady_idle_pct": 100.0 * d.get("steady_idle_s", 0.0) / steady if steady else 0.0,
        "forward_ms_per_plan": 1e3 * d.get("forward_s", 0.0) / plans,
        "postproc_ms_per_plan": 1e3 * d.get("postproc_busy_s", 0.0) / plans,
        "plans": d.get("num_plans", 0.0),
        "wasted_tokens": d.get("tokens_after_finish", 0.0),
        "delivered_tokens": d.get("tokens_delivered", 0.0),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """CPU seconds per process of a server tree (and of this load generator) over a run:
    on a CPU host every process shares the cores the forward pass runs on."""

    def __init__(self, root: int, label: str = "") -> None:
        self.pids = {p: label or role_of(p) for p in tree_pids(root)}
        self.start = {p: cpu_seconds(p) for p in self.pids}
        self.own = _own_cpu()

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, role in self.pids.items():
            if role == "shm tracker":
                continue
            used = cpu_seconds(pid) - self.start[pid]
            out[role] = out.get(role, 0.0) + max(used, 0.0)
        out["load generator"] = _own_cpu() - self.own
        return out


@dataclasses.dataclass
class Workload:
    """One seeded dataset for every arm and peer, built before any clock starts."""

    bench: BenchConfig
    items: list[Any]
    warmup_items: list[Any]  # other prompts: a warm-up must not seed the prefix cache
    tokenizer: Any

    @classmethod
    def build(cls, bench: BenchConfig) -> Workload:
        from tandem_serve.bench.serve import _load_tokenizer, build_dataset

        tok = _load_tokenizer(bench)
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


@contextlib.contextmanager
def beside_frontend(frontend_pid: int) -> Iterator[None]:
    """Run the load generator on the cores the server kept for its Python processes (where
    its frontend runs), so that a client never takes the pinned worker's core: with an
    accelerator it would not share the device either. A no-op when nothing is pinned."""
    mine = os.sched_getaffinity(0)
    try:
        theirs = os.sched_getaffinity(frontend_pid)
    except OSError:
        theirs = mine
    if theirs == mine:
        yield
        return
    os.sched_setaffinity(0, theirs)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


@contextlib.contextmanager
def arm_server(model: str, arm: Arm, extra: list[str]
               ) -> Iterator[tuple[subprocess.Popen, TandemClient, int, int]]:
    """A fresh `tandem serve` for one arm, SERVING on a free port (and, for an HTTP arm, a
    free HTTP port); stopped on exit."""
    port = free_port()
    http_port = free_port() if arm.http else 0
    proc = start_server(model, arm, extra, port, http_port)
    client = TandemClient(f"127.0.0.1:{port}")
    try:
        wait_ready(client, proc)
        yield proc, client, port, http_port
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    with arm_server(model, Arm(args.steps, True), [*extra, *args.server_arg]) as (
            proc, _client, port, _):
        with beside_frontend(proc.pid):
            for rep in range(args.repeats):
                order = list(arms.items())
                for name, changes in order if rep % 2 == 0 else order[::-1]:
                    r = work.run(port=port, model=model, **changes)
                    check(name, r)
                    runs.setdefault(name, []).append(r)
                    print(f"[bench {label}] {rep + 1}/{args.repeats} {name}: TPOT "
                          f"{r['mean_tpot_ms']:.2f} ms, {r['output_throughput']:.0f} tok/s",
                          file=sys.stderr, flush=True)
    return runs


def run_arm(model: str, arm: Arm, work: Workload, extra: list[str]) -> dict[str, Any]:
    with arm_server(model, arm, extra) as (proc, client, port, http_port):
        start: dict[str, Any] = {}

        def warmed() -> None:
            time.sleep(0.5)  # the scheduler reports counters every 0.2 s
            start["counters"] = _counters(client)
            start["meter"] = CpuMeter(proc.pid)

        target: dict[str, Any] = dict(port=port)
        if arm.http:
            target = dict(backend="openai-completions", port=http_port,
                          base_url=f"http://127.0.0.1:{http_port}")
        with beside_frontend(proc.pid):
            result = work.run(model=model, warmed=warmed, **target)
        result["cpu_s"] = start["meter"].stop()
        before = start["counters"]
        time.sleep(0.5)  # the scheduler reports counters every 0.2 s
        result.update(engine_figures(before, _counters(client)))
        return result


PEERS = tuple(PEER_NAMES)


def transformers_cli() -> str:
    """The `transformers` console script of this interpreter's environment."""
    here = os.path.join(os.path.dirname(sys.executable), "transformers")
    return here if os.path.exists(here) else "transformers"


def run_transformers_serve(model: str, work: Workload, timeout: float = 300.0
                           ) -> dict[str, Any]:
    """The same workload against `transformers serve --continuous-batching` on `model`."""
    import urllib.request

    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [transformers_cli(), "serve", "--continuous-batching", "--device", "cpu",
           "--port", str(port), model]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {proc.returncode} "
                                   "(is the bench extra installed?)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("transformers serve did not become ready") from None
                time.sleep(0.5)
        _first_completion(port, model)  # it loads the model on the first request
        meter: list[CpuMeter] = []
        result = work.run(backend="transformers-serve", port=port, model=model,
                          served_model_name=model,
                          warmed=lambda: meter.append(CpuMeter(proc.pid, "transformers serve")))
        result["cpu_s"] = meter[0].stop()
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _first_completion(port: int, model: str) -> None:
    import urllib.request

    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


def run_hf_generate(model: str, work: Workload) -> dict[str, Any]:
    """Static batches of `generate()` in this process: the bound with no server at all."""
    return work.run(backend="hf-generate", model=model, device="cpu")


def run_peer(name: str, model: str, work: Workload) -> dict[str, Any]:
    if name == "transformers-serve":
        return run_transformers_serve(model, work)
    if name == "hf-generate":
        return run_hf_generate(model, work)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


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
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every server (repeatable)")
    p.add_argument("--output-json", default="bench_ab.json")
    p.add_argument("--png", default="bench_ab.png")
    p.add_argument("--title", default="")


def engine_arms(steps: str, unpaced: bool, http: bool = False,
                peers: tuple[str, ...] = ()) -> list[Arm]:
    """sync and async for each K; with `unpaced`, async --no-pace-plans too where K > 1 (a
    one-step plan asks for the next one at its start either way); with `http`, each async
    arm over HTTP too, and with transformers serve among the peers at least the largest-K
    async arm, so that peer is compared through the same HTTP client."""
    kinds = [(False, True), (True, True), (True, False)]
    ks = [int(k) for k in steps.split(",")]
    arms = [Arm(k, a, paced) for k in ks for a, paced in kinds
            if paced or (unpaced and k > 1)]
    over_http = ks if http else [max(ks)] if "transformers-serve" in peers else []
    return arms + [Arm(k, True, True, http=True) for k in over_http]


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
    arms: list[Arm | str] = [*engine_arms(args.steps, args.unpaced, args.http, tuple(peers)),
                             *peers]
    runs: dict[str, list[dict[str, Any]]] = {}
    total = len(arms) * args.repeats
    n = 0
    for rep in range(args.repeats):
        # Alternate the order so a slow drift of the machine does not favour one side.
        for arm in arms if rep % 2 == 0 else arms[::-1]:
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
    for ratios in (http_ratios(results), peer_ratios(results)):
        if ratios:
            print()
            print(ratios)
    keep = [k for k, _ in COLUMNS] + ["completed", "duration", "median_tpot_ms", "p99_tpot_ms",
                                      "median_ttft_ms", "p99_itl_ms", "plans", "wasted_tokens",
                                      "delivered_tokens", "cpu_s", "repeats"]
    with open(args.output_json, "w") as f:
        json.dump({n: {k: r.get(k) for k in keep} for n, r in results.items()}, f, indent=2)
    chart(results, args.png, args.title or f"Tandem A/B on {os.path.basename(args.model)}")
    print(f"wrote {args.output_json} and {args.png}", file=sys.stderr)
    return 0
