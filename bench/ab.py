"""`tandem bench ab`: the sync/async × K table, each arm on a fresh server, same workload.

For every arm (K ∈ --steps × {sync, async}) it starts `tandem serve` on the same model,
runs the same seeded `bench serve` workload against it, and reads the engine's counters
before and after (admin Stats): device idle share (time the gpu worker waited for a plan)
over the whole run and in steady decode (plans without prefill), mean forward time per
plan and mean postprocessing time per plan, plus the CPU seconds each process used.
`--peers` runs the same workload against `transformers serve --continuous-batching` and
static-batch `generate()` in the same invocation.  It writes a markdown table with ratios
to sync K=1, a JSON file and a PNG chart.
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
from collections.abc import Iterator
from typing import Any

from bench.serve import BenchConfig, run_benchmark
from bench.soak import free_port, role_of, tree_pids
from rpc.client import TandemClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Arm:
    steps: int
    async_mode: bool
    paced: bool = True  # async only: --pace-plans (the default) or --no-pace-plans

    @property
    def name(self) -> str:
        mode = "sync" if not self.async_mode else "async" if self.paced else "async unpaced"
        return f"{mode} K={self.steps}"


def start_server(model: str, arm: Arm, extra: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", model, "--port", str(port),
           "--num-scheduler-steps", str(arm.steps),
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
        from bench.serve import _load_tokenizer, build_dataset

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
               ) -> Iterator[tuple[subprocess.Popen, TandemClient, int]]:
    """A fresh `tandem serve` for one arm, SERVING on a free port; stopped on exit."""
    port = free_port()
    proc = start_server(model, arm, extra, port)
    client = TandemClient(f"127.0.0.1:{port}")
    try:
        wait_ready(client, proc)
        yield proc, client, port
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_arm(model: str, arm: Arm, work: Workload, extra: list[str]) -> dict[str, Any]:
    with arm_server(model, arm, extra) as (proc, client, port):
        start: dict[str, Any] = {}

        def warmed() -> None:
            time.sleep(0.5)  # the scheduler reports counters every 0.2 s
            start["counters"] = _counters(client)
            start["meter"] = CpuMeter(proc.pid)

        with beside_frontend(proc.pid):
            result = work.run(port=port, model=model, warmed=warmed)
        result["cpu_s"] = start["meter"].stop()
        before = start["counters"]
        time.sleep(0.5)  # the scheduler reports counters every 0.2 s
        result.update(engine_figures(before, _counters(client)))
        return result


PEERS = ("transformers-serve", "hf-generate")
PEER_NAMES = {"transformers-serve": "transformers serve", "hf-generate": "hf generate()"}


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


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of repeated runs (numbers only; CPU seconds per process too)."""
    import statistics

    out = dict(runs[-1])
    for key, value in runs[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(float(r[key]) for r in runs if key in r)
    roles = {role for r in runs for role in r.get("cpu_s", {})}
    out["cpu_s"] = {role: statistics.median(r.get("cpu_s", {}).get(role, 0.0) for r in runs)
                    for role in sorted(roles)}
    out["repeats"] = len(runs)
    return out


COLUMNS = [("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("mean_itl_ms", "ITL ms"),
           ("output_throughput", "out tok/s"), ("device_idle_pct", "device idle %"),
           ("steady_idle_pct", "idle % in steady decode"),
           ("forward_ms_per_plan", "forward ms/plan"),
           ("postproc_ms_per_plan", "postproc ms/plan")]


def _cell(r: dict[str, Any], key: str) -> str:
    v = r.get(key)
    return "–" if v is None else f"{v:.2f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per arm, with ratios to sync K=1 (or, without it, to the first sync arm)."""
    syncs = [n for n in results if n.startswith("sync K=")]
    base_name = "sync K=1" if "sync K=1" in results else syncs[0] if syncs else ""
    base = results.get(base_name)
    head = "| arm | " + " | ".join(c for _, c in COLUMNS) + \
        f" | TPOT vs {base_name or 'sync'} | throughput vs {base_name or 'sync'} |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for name, r in results.items():
        cells = [_cell(r, k) for k, _ in COLUMNS]
        if base:
            cells += [f"{r['mean_tpot_ms'] / base['mean_tpot_ms']:.2f}×",
                      f"{r['output_throughput'] / base['output_throughput']:.2f}×"]
        else:
            cells += ["–", "–"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(results: dict[str, dict[str, Any]]) -> str:
    """CPU seconds per process over each run: where a CPU host's cores went."""
    roles: list[str] = []
    for r in results.values():
        roles += [k for k in r.get("cpu_s", {}) if k not in roles]
    lines = ["| arm | wall s | " + " | ".join(roles) + " |", "|" + "---|" * (len(roles) + 2)]
    for name, r in results.items():
        cpu = r.get("cpu_s", {})
        cells = [f"{cpu[k]:.2f}" if k in cpu else "–" for k in roles]
        lines.append(f"| {name} | {r.get('duration', 0.0):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_ratios(results: dict[str, dict[str, Any]]) -> str:
    """Output throughput of Tandem's async arm with the largest K over each peer's, measured
    in the same run."""
    ours = [n for n in results if n.startswith("async K=")]
    if not ours:
        return ""
    arm = max(ours, key=lambda n: int(n.split("=")[1]))
    mine = results[arm]["output_throughput"]
    parts = [f"{arm} output throughput = {mine / r['output_throughput']:.2f}× {name}'s"
             for name, r in results.items()
             if name in PEER_NAMES.values() and r.get("output_throughput")]
    return "; ".join(parts)


def chart(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(4.4 * 3, 3.8))
    for ax, (key, label) in zip(axes, [("mean_tpot_ms", "mean TPOT (ms)"),
                                       ("output_throughput", "output tok/s"),
                                       ("steady_idle_pct", "device idle in steady decode (%)")],
                                 strict=True):
        raw = [results[n].get(key) for n in names]
        values = [v or 0.0 for v in raw]
        colors = ["#9ecae1" if "unpaced" in n else "#1f77b4" if "async" in n
                  else "#ff7f0e" if "sync" in n else "#7f7f7f" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=25)
        for i, v in enumerate(raw):  # a peer has no engine counters: say so, not 0
            ax.text(i, v or 0.0, "n/a" if v is None else f"{v:.1f}", ha="center",
                    va="bottom", fontsize=8)
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
    p.add_argument("--unpaced", action="store_true",
                   help="also run async arms with --no-pace-plans (plan n+1 built as soon as "
                        "plan n is sent), for K > 1")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every server (repeatable)")
    p.add_argument("--output-json", default="bench_ab.json")
    p.add_argument("--png", default="bench_ab.png")
    p.add_argument("--title", default="")


def engine_arms(steps: str, unpaced: bool) -> list[Arm]:
    """sync and async for each K; with `unpaced`, async --no-pace-plans too where K > 1 (a
    one-step plan asks for the next one at its start either way)."""
    kinds = [(False, True), (True, True), (True, False)]
    return [Arm(int(k), a, paced) for k in steps.split(",") for a, paced in kinds
            if paced or (unpaced and int(k) > 1)]


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
    arms: list[Arm | str] = [*engine_arms(args.steps, args.unpaced), *peers]
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
    ratios = peer_ratios(results)
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
