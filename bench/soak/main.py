"""`tandem bench soak`: a steady request rate for minutes; does any process keep growing?

It starts a server (or attaches to one with `--target` and `--pid`), drives Poisson
arrivals at `--request-rate` through gRPC streams from a thread pool (a mix of plain,
token-detail, stop-sequence, sampled, cancelled-mid-stream and, with `--guided-share`,
guided requests, so every output path runs: `mix.py`), and samples
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
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from tandem_serve.bench.soak.load import drive
from tandem_serve.bench.soak.mix import DEFAULT_MIX, RequestStats, parse_mix
from tandem_serve.bench.soak.rss import ProcessRss, Windows, format_table, growth_pct, sample
from tandem_serve.harness.processes import (
    find_frontend,
    free_port,
    rss_kb,
    stop_process,
)
from tandem_serve.harness.server import start_server, wait_idle, wait_serving
from tandem_serve.harness.stats import percentile


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
        port = free_port()
        proc = start_server(args.model, shlex.split(args.server_args), port)
        target, pid = f"127.0.0.1:{port}", proc.pid
    client = TandemClient(target)
    stop = threading.Event()
    stats = RequestStats()
    procs: dict[int, ProcessRss] = {}
    load_s = args.warmup_s + args.minutes * 60.0
    try:
        wait_serving(client, proc, timeout=300.0)
        print(f"bench soak: {target} pid {pid}: {args.request_rate:g} req/s for "
              f"{args.warmup_s:g} s warm-up + {args.minutes:g} min", file=sys.stderr)
        t_end = run_load(client, args, mix, pid, load_s, stats, stop, procs)
        # For the record only: idle memory is not comparable with the start sample, which
        # was taken under load (allocators give memory back when streams close).
        for proc_rss in procs.values():
            proc_rss.idle_after_kb = rss_kb(proc_rss.pid)
        # Cancelled and finished requests gave every KV block back.
        after = wait_idle(client, timeout=30)
    except KeyboardInterrupt:
        stop.set()
        return 130
    finally:
        client.close()
        if proc is not None:
            stop_process(proc)
    rows = sorted(procs.values(), key=lambda p: p.pid)
    windows = Windows.of(args.warmup_s, load_s, args.window_s)
    print(format_table(rows, windows))
    leaked = after.num_total_blocks - after.num_free_blocks
    print_requests(stats, after, t_end)
    worst = max((g for p in rows if (g := growth_pct(*windows.readings(p))) is not None),
                default=0.0)
    if args.json:
        write_json(args, target, t_end, stats, leaked, windows, rows)
    if sum(stats.failed.values()) or leaked or after.num_running:
        return 1
    if args.max_growth_pct and worst > args.max_growth_pct:
        return 1
    return 0


def run_load(client: Any, args: argparse.Namespace, mix: dict[str, float], pid: int,
             load_s: float, stats: RequestStats, stop: threading.Event,
             procs: dict[int, ProcessRss]) -> float:
    """Drive the load for `load_s` seconds, sampling RSS every `--sample-every` seconds under
    load; returns how long it took."""
    driver = threading.Thread(target=lambda: drive(
        client, args.request_rate, load_s, args.max_new_tokens, args.concurrency, stats,
        stop, args.seed, mix), name="soak-driver")
    t0 = time.monotonic()
    driver.start()
    next_sample = 0.0
    while driver.is_alive():
        now = time.monotonic() - t0
        if now >= next_sample and now < load_s:  # start and end both under load
            sample(pid, now, procs)
            with stats.lock:
                done, failed = stats.ok, sum(stats.failed.values())
            print(f"  t={now:6.0f}s  {done} ok  {failed} failed", file=sys.stderr)
            next_sample = now + args.sample_every
        driver.join(timeout=min(1.0, max(0.05, next_sample - now)))
    return time.monotonic() - t0


def print_requests(stats: RequestStats, after: Any, t_end: float) -> None:
    """How the requests ended, their latency, and what the server holds after the load."""
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


def write_json(args: argparse.Namespace, target: str, t_end: float, stats: RequestStats,
               leaked: int, windows: Windows, rows: list[ProcessRss]) -> None:
    lat = stats.latencies
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
