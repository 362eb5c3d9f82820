"""`tandem bench ipc`: the shared-memory ring against plain ZeroMQ ipc, in one run.

Measures, for one message size (1 KB by default):
  * round-trip latency p50/p99: this process puts a message, an echo process sends it back
    over its own return path (a second ring / a second PUSH-PULL pair);
  * one-way throughput (msgs/s, MB/s with MB = 10^6 bytes): put back to back, the echo process
    counts them and acknowledges the total;
  * the CPU an idle ring reader uses (its own process_time over the window, all threads, as %
    of one core), which shows whether the spin-then-doorbell wait really sleeps.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from typing import Any

from tandem_serve.bench.ipc.measure import bench_ring, bench_zmq


def report(figures: dict[str, Any]) -> str:
    size = figures["message_bytes"]
    lines = [
        f"tandem bench ipc: {size}-byte messages, {figures['round_trips']} round trips, "
        f"{figures['messages']} one-way messages",
        f"{'transport':<10} {'rt p50 µs':>10} {'rt p99 µs':>10} {'one-way msg/s':>14} "
        f"{'one-way MB/s':>13}",
    ]
    for key, label in (("ring", "shm ring"), ("zmq_ipc", "zmq ipc")):
        f = figures[key]
        lines.append(f"{label:<10} {f['rt_p50_us']:>10.1f} {f['rt_p99_us']:>10.1f} "
                     f"{f['oneway_msgs_per_s']:>14,.0f} {f['oneway_mb_per_s']:>13.1f}")
    ring = figures["ring"]
    lines.append(f"idle ring reader: {ring['idle_cpu_pct']:.2f}% of one core "
                 f"({ring['idle_cpu_s'] * 1000:.1f} ms CPU over {ring['idle_seconds']:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench ipc", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="message size in bytes")
    parser.add_argument("--round-trips", type=int, default=20000)
    parser.add_argument("--messages", type=int, default=100000, help="one-way messages")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.size < 2 or args.round_trips < 1 or args.messages < 1:
        parser.error("--size must be >= 2, --round-trips and --messages >= 1")
    tmp = tempfile.mkdtemp(prefix="tandem_bench_ipc_")
    try:
        figures: dict[str, Any] = {
            "message_bytes": args.size, "round_trips": args.round_trips,
            "messages": args.messages,
            "ring": bench_ring(tmp, args.size, args.round_trips, args.messages,
                               args.idle_seconds),
            "zmq_ipc": bench_zmq(tmp, args.size, args.round_trips, args.messages),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
