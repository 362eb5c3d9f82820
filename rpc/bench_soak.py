"""`tandem bench soak`: a steady request rate for minutes; does any process keep growing?

It starts a server (or attaches to one with `--target` and `--pid`), drives Poisson
arrivals at `--request-rate` through `TandemClient` streams from a thread pool (a mix of
plain, token-detail and stop-sequence requests, so every output path runs), and samples
the resident set size (VmRSS in /proc/<pid>/status) of every process of the server's tree.
The first sample after `--warmup-s` is the start and the last one taken under load the end
(both under load: allocators hand memory back once streams close, so an idle sample would
flatter the end); the table shows per process (role from its `tandem: <role>` title)
start, end, growth and the idle size after the load, and `--json` writes the whole series.
With `--max-growth-pct` the exit code says whether it held.

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

WORDS = ("time river model token stream engine quick brown fox jumps over lazy dog light "
         "paper window garden number seven north market silver cloud winter music").split()


@dataclass
class ProcessRss:
    pid: int
    role: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, kB) under load
    idle_after_kb: int | None = None  # once the last request finished

    def at(self, t: float) -> int | None:
        """The first sample at or after `t` seconds (None if there is none)."""
        return next((kb for s, kb in self.samples if s >= t), None)

    def last(self) -> int | None:
        return self.samples[-1][1] if self.samples else None


@dataclass
class RequestStats:
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    start_delays: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


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


def make_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def one_request(client: Any, rng_seed: int, max_new_tokens: int, stats: RequestStats,
                scheduled: float) -> None:
    import grpc

    from rpc.client import GenerateOptions

    rng = random.Random(rng_seed)
    kind = rng_seed % 4
    opts = GenerateOptions(max_new_tokens=rng.randint(max(1, max_new_tokens // 4),
                                                      max_new_tokens))
    if kind == 1:  # token detail: logprobs, ranks, top-n text per token
        opts.generated_tokens, opts.token_logprobs, opts.token_ranks = True, True, True
        opts.top_n_tokens = 3
    elif kind == 2:  # stop strings: the postproc side's matcher and early finishes
        opts.stop_sequences = [rng.choice(WORDS), "\n\n"]
    elif kind == 3:  # sampling with a seed
        opts.sample, opts.temperature, opts.top_p, opts.seed = True, 0.8, 0.9, rng_seed
    start = time.monotonic()
    tokens = 0
    try:
        for resp in client.stream(make_prompt(rng), opts, timeout=300):
            tokens = resp.generated_token_count or tokens
    except grpc.RpcError as exc:
        code = exc.code().name if exc.code() is not None else "UNKNOWN"
        with stats.lock:
            stats.failed[code] = stats.failed.get(code, 0) + 1
        return
    with stats.lock:
        stats.ok += 1
        stats.tokens += tokens
        stats.latencies.append(time.monotonic() - start)
        stats.start_delays.append(start - scheduled)


def drive(client: Any, rate: float, seconds: float, max_new_tokens: int, concurrency: int,
          stats: RequestStats, stop: threading.Event, seed: int = 0) -> int:
    """Poisson arrivals at `rate` per second for `seconds`; returns how many were sent."""
    rng = random.Random(seed)
    sent = 0
    t0 = time.monotonic()
    next_at = t0
    with ThreadPoolExecutor(concurrency, thread_name_prefix="soak") as pool:
        while not stop.is_set():
            next_at += rng.expovariate(rate)
            if next_at - t0 > seconds:
                break
            delay = next_at - time.monotonic()
            if delay > 0 and stop.wait(delay):
                break
            pool.submit(one_request, client, seed * 1_000_003 + sent, max_new_tokens, stats,
                        next_at)
            sent += 1
    return sent


# ---------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rpc.cli", "serve", "--port", str(port),
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


def format_table(procs: list[ProcessRss], t_start: float) -> str:
    lines = [f"{'process':<14}{'pid':>8}{'RSS start MB':>14}{'RSS end MB':>12}{'growth':>9}"
             f"{'idle after MB':>15}", "-" * 72]
    for p in procs:
        start, end = p.at(t_start), p.last()
        g = growth_pct(start, end)
        lines.append(f"{p.role:<14}{p.pid:>8}"
                     f"{(start or 0) / 1024:>14.1f}{(end or 0) / 1024:>12.1f}"
                     f"{'' if g is None else f'{g:+.1f}%':>9}"
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
                   help="load before the start sample: caches, allocator pools fill up")
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


def main(args: argparse.Namespace) -> int:
    from rpc.client import TandemClient

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
            stop, args.seed), name="soak-driver")
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
    t_start = args.warmup_s
    print(format_table(rows, t_start))
    lat = stats.latencies
    failed = sum(stats.failed.values())
    print(f"requests: {stats.ok} ok, {failed} failed {stats.failed or ''}; "
          f"{stats.ok / max(t_end, 1e-9):.2f} req/s, {stats.tokens} tokens; latency p50 "
          f"{percentile(lat, 50):.2f} s p99 {percentile(lat, 99):.2f} s; start delay p99 "
          f"{percentile(stats.start_delays, 99):.3f} s")
    worst = max((g for p in rows if (g := growth_pct(p.at(t_start), p.last())) is not None),
                default=0.0)
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "func"},
               "target": target, "seconds": t_end,
               "requests": {"ok": stats.ok, "failed": stats.failed, "tokens": stats.tokens,
                            "latency_p50_s": percentile(lat, 50),
                            "latency_p99_s": percentile(lat, 99)},
               "processes": [{**asdict(p), "rss_start_kb": p.at(t_start),
                              "rss_end_kb": p.last(),
                              "growth_pct": growth_pct(p.at(t_start), p.last())}
                             for p in rows]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if failed:
        return 1
    if args.max_growth_pct and worst > args.max_growth_pct:
        return 1
    return 0
