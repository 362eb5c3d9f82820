"""`tandem bench soak`: a steady request rate for minutes; does any process keep growing?

It starts a server (or attaches to one with `--target` and `--pid`), drives Poisson
arrivals at `--request-rate` through gRPC streams from a thread pool (a mix of plain,
token-detail, stop-sequence, sampled, cancelled-mid-stream and, with `--guided-share`,
guided requests, so every output path runs: `bench/soak_mix.py`), and samples
the resident set size (VmRSS in /proc/<pid>/status) of every process of the server's tree.
One-time allocations (oneDNN primitives for new shapes, allocator pools) happen in the first
`--warmup-s` of load, which the comparison leaves out. The start is the median of the samples
in the first `--window-s` after the warm-up and the end the median of those in the last
`--window-s` under load: one sample swings by the buffers of whatever step is running at that
instant (tens of MB in the gpu worker), a median of several does not. Both are under load:
allocators hand memory back once streams close, so an idle end would flatter it. Per process
(role from its `tandem: <role>` title) the table shows the RSS at the first sample, start, end,
growth, the least-squares slope over every sample after the warm-up (MB/min) and the idle size
after the load; `--json` writes the whole series. After the load the admin counters must show
every KV block free and nothing running. With `--max-growth-pct` the exit code says whether
it held.

    tandem bench soak --minutes 10 --request-rate 4
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem_serve.bench.soak_mix import DEFAULT_MIX, RequestStats, parse_mix, run_one
from tandem_serve.ipc.process import CLI

DEFAULT = parse_mix(DEFAULT_MIX, 0.0)

@dataclass
class ProcessRss:
    pid: int
    role: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, kB) under load
    idle_after_kb: int | None = None  # once the last request finished

    def first(self) -> int | None:
        return self.samples[0][1] if self.samples else None

    def median(self, t0: float, t1: float) -> int | None:
        """Median kB of the samples taken in [t0, t1) seconds (None if there are none)."""
        kb = sorted(k for s, k in self.samples if t0 <= s < t1)
        return kb[len(kb) // 2] if kb else None

    def slope_mb_per_min(self, t0: float) -> float | None:
        """Least-squares RSS slope over the samples from `t0` on, in MB per minute."""
        pts = [(s, k / 1024) for s, k in self.samples if s >= t0]
        if len(pts) < 3:
            return None
        mt = sum(s for s, _ in pts) / len(pts)
        mm = sum(m for _, m in pts) / len(pts)
        var = sum((s - mt) ** 2 for s, _ in pts)
        return 60.0 * sum((s - mt) * (m - mm) for s, m in pts) / var if var else None


@dataclass(frozen=True)
class Windows:
    """Where the start and end readings come from, in seconds since the load began."""

    warmup_s: float
    start: tuple[float, float]
    end: tuple[float, float]

    @classmethod
    def of(cls, warmup_s: float, load_s: float, window_s: float) -> Windows:
        # Never wider than half the measured span, so the two windows do not overlap.
        w = max(0.0, min(window_s, (load_s - warmup_s) / 2))
        return cls(warmup_s, (warmup_s, warmup_s + w), (load_s - w, load_s))

    def describe(self) -> str:
        return (f"RSS start = median of the samples at {self.start[0]:g}-{self.start[1]:g} s "
                f"of load (after a {self.warmup_s:g} s warm-up), end = median at "
                f"{self.end[0]:g}-{self.end[1]:g} s; MB/min = least-squares slope from "
                f"{self.warmup_s:g} s on")

    def readings(self, p: ProcessRss) -> tuple[int | None, int | None]:
        return p.median(*self.start), p.median(*self.end)


# ---------------------------------------------------------------------- processes


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out = [root]
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def role_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if args and args[0].startswith("tandem: "):  # setproctitle
        return args[0][len("tandem: "):].strip()
    if "run-role" in args:
        i = args.index("run-role")
        role = args[i + 1] if i + 1 < len(args) else "?"
        if role == "postproc" and "--index" in args:
            role += " " + args[args.index("--index") + 1]
        return role
    if any("resource_tracker" in a for a in args):  # multiprocessing's, for shm segments
        return "shm tracker"
    return "frontend" if "serve" in args else os.path.basename(args[0]) if args else "?"


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def find_frontend() -> int | None:
    """The pid of the only `tandem: frontend` process on this host, if there is one."""
    found = [int(e) for e in os.listdir("/proc") if e.isdigit() and role_of(int(e)) == "frontend"]
    return found[0] if len(found) == 1 else None


# ---------------------------------------------------------------------- load


def drive(client: Any, rate: float, seconds: float, max_new_tokens: int, concurrency: int,
          stats: RequestStats, stop: threading.Event, seed: int = 0,
          mix: dict[str, float] | None = None) -> int:
    """Poisson arrivals at `rate` per second for `seconds`; returns how many were sent."""
    rng = random.Random(seed)
    sent = 0
    t0 = time.monotonic()
    next_at = t0
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="soak")
    try:
        while not stop.is_set():
            next_at += rng.expovariate(rate)
            if next_at - t0 > seconds:
                break
            delay = next_at - time.monotonic()
            if delay > 0 and stop.wait(delay):
                break
            pool.submit(run_one, client, seed * 1_000_003 + sent, mix or DEFAULT, max_new_tokens,
                        stats, next_at)
            sent += 1
            stats.sent = sent
    finally:
        # Requests still queued behind `concurrency` open streams (a rate above what the
        # server keeps up with) are dropped: the sampling is over, draining them could take
        # longer than the soak itself. Open streams finish.
        pool.shutdown(wait=True, cancel_futures=True)
    return sent


# ---------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [*CLI, "serve", "--port", str(port), "--http-port", "0",
           "--log-level", "WARNING", *(["--model", model] if model else []), *extra]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root, stdin=subprocess.DEVNULL)
    return proc, f"127.0.0.1:{port}"


def wait_serving(client: Any, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} while starting")
        if client.is_serving():
            return
        time.sleep(0.25)
    raise TimeoutError(f"server not serving after {timeout:g} s")


# ---------------------------------------------------------------------- report


def growth_pct(start: int | None, end: int | None) -> float | None:
    if not start or end is None:
        return None
    return 100.0 * (end - start) / start


def format_table(procs: list[ProcessRss], windows: Windows) -> str:
    lines = [windows.describe(),
             f"{'process':<14}{'pid':>8}{'at 0 s MB':>11}{'start MB':>10}{'end MB':>9}"
             f"{'growth':>9}{'MB/min':>8}{'idle after MB':>15}", "-" * 84]
    for p in procs:
        start, end = windows.readings(p)
        g = growth_pct(start, end)
        slope = p.slope_mb_per_min(windows.warmup_s)
        lines.append(f"{p.role:<14}{p.pid:>8}{(p.first() or 0) / 1024:>11.1f}"
                     f"{(start or 0) / 1024:>10.1f}{(end or 0) / 1024:>9.1f}"
                     f"{'' if g is None else f'{g:+.1f}%':>9}"
                     f"{'' if slope is None else f'{slope:+.2f}':>8}"
                     f"{(p.idle_after_kb or 0) / 1024:>15.1f}")
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# ---------------------------------------------------------------------- main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="load time after the warm-up")
    p.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals per s")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="each request asks for between a quarter of this and this")
    p.add_argument("--concurrency", type=int, default=64, help="most streams open at once")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="load before the start window: caches, allocator pools fill up")
    p.add_argument("--window-s", type=float, default=60.0,
                   help="start and end RSS are medians of the samples in a window this long")
    p.add_argument("--sample-every", type=float, default=10.0, help="RSS sampling period, s")
    p.add_argument("--target", default="", help="attach to HOST:PORT instead of starting")
    p.add_argument("--pid", type=int, default=0,
                   help="with --target: the server's frontend pid (default: the only one)")
    p.add_argument("--model", default="", help="for the started server (default: tiny)")
    p.add_argument("--server-args", default="--num-scheduler-steps 4",
                   help="extra `tandem serve` flags for the started server, one string")
    p.add_argument("--json", default="", help="write the samples and summary here")
    p.add_argument("--max-growth-pct", type=float, default=0.0,
                   help="exit 1 when any process grew more than this (0: report only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default=DEFAULT_MIX,
                   help="request kinds and weights: plain, detail (logprobs, ranks, top-n), "
                        "stop (stop sequences), sample, cancel (cancelled mid-stream)")
    p.add_argument("--guided-share", type=float, default=0.0,
                   help="share of all requests with a guided-decoding constraint (needs a "
                        "server with guided decoding)")


def main(args: argparse.Namespace) -> int:
    from tandem_serve.rpc.client import TandemClient

    try:
        mix = parse_mix(args.mix, args.guided_share)
    except ValueError as exc:
        print(f"bench soak: {exc}", file=sys.stderr)
        return 2

    proc: subprocess.Popen | None = None
    if args.target:
        target = args.target
        pid = args.pid or find_frontend()
        if not pid:
            print("bench soak: give --pid of the server's frontend process", file=sys.stderr)
            return 2
    else:
        proc, target = start_server(args.model, shlex.split(args.server_args))
        pid = proc.pid
    client = TandemClient(target)
    stop = threading.Event()
    stats = RequestStats()
    procs: dict[int, ProcessRss] = {}
    load_s = args.warmup_s + args.minutes * 60.0
    try:
        wait_serving(client, proc, timeout=300.0)
        print(f"bench soak: {target} pid {pid}: {args.request_rate:g} req/s for "
              f"{args.warmup_s:g} s warm-up + {args.minutes:g} min", file=sys.stderr)
        driver = threading.Thread(target=lambda: drive(
            client, args.request_rate, load_s, args.max_new_tokens, args.concurrency, stats,
            stop, args.seed, mix), name="soak-driver")
        t0 = time.monotonic()
        driver.start()
        next_sample = 0.0
        while driver.is_alive():
            now = time.monotonic() - t0
            if now >= next_sample and now < load_s:  # start and end both under load
                for p in tree_pids(pid):
                    kb = rss_kb(p)
                    if kb is not None:
                        procs.setdefault(p, ProcessRss(p, role_of(p))).samples.append((now, kb))
                with stats.lock:
                    done, failed = stats.ok, sum(stats.failed.values())
                print(f"  t={now:6.0f}s  {done} ok  {failed} failed", file=sys.stderr)
                next_sample = now + args.sample_every
            driver.join(timeout=min(1.0, max(0.05, next_sample - now)))
        t_end = time.monotonic() - t0
        # For the record only: idle memory is not comparable with the start sample, which
        # was taken under load (allocators give memory back when streams close).
        for proc_rss in procs.values():
            proc_rss.idle_after_kb = rss_kb(proc_rss.pid)
        # Cancelled and finished requests gave every KV block back.
        from tandem_serve.bench.robustness import wait_idle

        after = wait_idle(client, timeout=30)
    except KeyboardInterrupt:
        stop.set()
        return 130
    finally:
        client.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    rows = sorted(procs.values(), key=lambda p: p.pid)
    windows = Windows.of(args.warmup_s, load_s, args.window_s)
    print(format_table(rows, windows))
    lat = stats.latencies
    failed = sum(stats.failed.values())
    dropped = stats.sent - stats.ok - stats.cancelled - failed
    leaked = after.num_total_blocks - after.num_free_blocks
    print(f"requests: {stats.sent} sent, {stats.ok} ok, {stats.cancelled} cancelled by the "
          f"client mid-stream, {failed} failed"
          f"{f' {stats.failed}' if stats.failed else ''}"
          f"{f', {dropped} never started (queued when the load ended)' if dropped else ''}; "
          f"{stats.ok / max(t_end, 1e-9):.2f} req/s, {stats.tokens} tokens; latency p50 "
          f"{percentile(lat, 50):.2f} s p99 {percentile(lat, 99):.2f} s; start delay p99 "
          f"{percentile(stats.start_delays, 99):.3f} s")
    print("by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(stats.by_kind.items()))
          + f"; after the load: {leaked} KV blocks in use, {after.num_running} running, "
          f"{after.num_waiting} waiting")
    worst = max((g for p in rows if (g := growth_pct(*windows.readings(p))) is not None),
                default=0.0)
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "func"},
               "target": target, "seconds": t_end,
               "requests": {"sent": stats.sent, "ok": stats.ok, "failed": stats.failed,
                            "cancelled": stats.cancelled, "by_kind": dict(stats.by_kind),
                            "tokens": stats.tokens, "blocks_in_use_after": leaked,
                            "latency_p50_s": percentile(lat, 50),
                            "latency_p99_s": percentile(lat, 99)},
               "windows": asdict(windows),
               "processes": [{**asdict(p), "rss_start_kb": windows.readings(p)[0],
                              "rss_end_kb": windows.readings(p)[1],
                              "growth_pct": growth_pct(*windows.readings(p)),
                              "slope_mb_per_min": p.slope_mb_per_min(windows.warmup_s)}
                             for p in rows]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if failed or leaked or after.num_running:
        return 1
    if args.max_growth_pct and worst > args.max_growth_pct:
        return 1
    return 0
