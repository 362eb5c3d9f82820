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
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq

from tandem_serve.ipc.shm_ring import RingReader, RingWriter, unlink_ipc_file, unlink_segment

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Message kinds: first byte of frame 0.
_ECHO, _COUNT, _TALLY, _IDLE, _IDLE_END, _QUIT = b"E", b"T", b"C", b"I", b"J", b"Q"


# -- echo child --------------------------------------------------------------------------

def _serve(recv: Callable[[float], bytes | None], send: Callable[[bytes], None]) -> None:
    """The echo loop both transports share: dispatch on the first byte."""
    counted = 0
    idle_start: tuple[float, float] | None = None
    while True:
        msg = recv(0.5)
        if msg is None:
            continue
        kind = msg[:1]
        if kind == _ECHO:
            send(msg)
        elif kind == _COUNT:
            counted += 1
        elif kind == _TALLY:
            send(_TALLY + str(counted).encode())
            counted = 0
        elif kind == _IDLE:
            idle_start = (time.process_time(), time.monotonic())
        elif kind == _IDLE_END and idle_start is not None:
            cpu = time.process_time() - idle_start[0]
            wall = time.monotonic() - idle_start[1]
            send(_IDLE_END + json.dumps({"cpu_s": cpu, "wall_s": wall}).encode())
        elif kind == _QUIT:
            return


def _child_ring(name_in: str, name_out: str, addrs: list[str]) -> None:
    reader = RingReader(name_in, 0, addrs[0], addrs[1])
    writer = RingWriter(name_out, 1, addrs[2], addrs[3])
    try:
        writer.wait_ready(10.0)

        def recv(timeout: float) -> bytes | None:
            frames = reader.get_frames(timeout)
            return None if frames is None else bytes(frames[0])

        _serve(recv, lambda msg: writer.put_frames([msg]))
    finally:
        writer.close()
        reader.close()


def _child_zmq(addr_in: str, addr_out: str) -> None:
    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.connect(addr_in)
        push.connect(addr_out)

        def recv(timeout: float) -> bytes | None:
            if not pull.poll(int(timeout * 1000)):
                return None
            return pull.recv()

        _serve(recv, push.send)
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()


def _child_main(argv: list[str]) -> int:
    if argv[0] == "ring":
        _child_ring(argv[1], argv[2], argv[3:7])
    else:
        _child_zmq(argv[1], argv[2])
    return 0


def _spawn_child(args: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO_ROOT, env.get("PYTHONPATH")]))
    code = ("import sys; from tandem_serve.bench.ipc import _child_main; "
            "sys.exit(_child_main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env)


# -- measuring ---------------------------------------------------------------------------

class _Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.tty = sys.stderr.isatty()
        self.next_pct = 0

    def update(self, done: int) -> None:
        pct = done * 100 // self.total
        if pct < self.next_pct:
            return
        self.next_pct = pct + (2 if self.tty else 25)
        end = "\r" if self.tty and done < self.total else "\n"
        print(f"  {self.label}: {pct:3d}%", end=end, file=sys.stderr, flush=True)


class _Transport:
    """What the measurements need from either transport, on the driving side."""

    def __init__(self, send: Callable[[bytes], None], recv: Callable[[], bytes]) -> None:
        self.send, self.recv = send, recv


def _round_trips(tr: _Transport, msg: bytes, count: int, warmup: int, label: str) -> list[int]:
    progress = _Progress(label, count)
    for _ in range(warmup):
        tr.send(msg)
        tr.recv()
    samples: list[int] = []
    clock = time.perf_counter_ns
    for i in range(count):
        start = clock()
        tr.send(msg)
        tr.recv()
        samples.append(clock() - start)
        if i % 1000 == 0:
            progress.update(i)
    progress.update(count)
    return samples


def _one_way(tr: _Transport, msg: bytes, count: int, label: str) -> float:
    progress = _Progress(label, count)
    start = time.perf_counter()
    for i in range(count):
        tr.send(msg)
        if i % 5000 == 0:
            progress.update(i)
    tr.send(_TALLY)
    reply = tr.recv()
    elapsed = time.perf_counter() - start
    progress.update(count)
    got = int(reply[1:])
    if got != count:
        raise RuntimeError(f"{label}: the echo process counted {got} of {count} messages")
    return elapsed


def _percentile(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _measure(tr: _Transport, name: str, size: int, round_trips: int,
             messages: int) -> dict[str, float]:
    echo = _ECHO + b"x" * (size - 1)
    count = _COUNT + b"x" * (size - 1)
    print(f"[{name}] round trips", file=sys.stderr, flush=True)
    samples = _round_trips(tr, echo, round_trips, min(2000, round_trips), f"{name} round trip")
    print(f"[{name}] one-way throughput", file=sys.stderr, flush=True)
    elapsed = _one_way(tr, count, messages, f"{name} one-way")
    return {
        "rt_p50_us": _percentile(samples, 0.50),
        "rt_p99_us": _percentile(samples, 0.99),
        "rt_mean_us": statistics.fmean(samples) / 1000.0,
        "oneway_msgs_per_s": messages / elapsed,
        "oneway_mb_per_s": messages * size / elapsed / 1e6,
    }


def _idle_cpu(tr: _Transport, seconds: float) -> dict[str, float]:
    print(f"[ring] idle reader for {seconds:g} s", file=sys.stderr, flush=True)
    tr.send(_IDLE)
    time.sleep(seconds)
    tr.send(_IDLE_END)
    stats = json.loads(tr.recv()[1:])
    return {"idle_seconds": stats["wall_s"], "idle_cpu_s": stats["cpu_s"],
            "idle_cpu_pct": 100.0 * stats["cpu_s"] / stats["wall_s"]}


def _stop(child: subprocess.Popen[bytes], tr: _Transport | None) -> None:
    if tr is not None and child.poll() is None:
        try:
            tr.send(_QUIT)
            child.wait(5)
        except Exception:  # the echo process is already broken; the kill below settles it
            pass
    if child.poll() is None:
        child.kill()
        child.wait()


def _bench_ring(tmp: str, size: int, round_trips: int, messages: int,
                idle_s: float) -> dict[str, float]:
    pid = os.getpid()
    name_a, name_b = f"tandem_{pid}_bench_a", f"tandem_{pid}_bench_b"
    addrs = [f"ipc://{tmp}/{n}" for n in ("a_bell", "a_side", "b_bell", "b_side")]
    writer: RingWriter | None = None
    reader: RingReader | None = None
    child: subprocess.Popen[bytes] | None = None
    tr: _Transport | None = None
    try:
        writer = RingWriter(name_a, 1, addrs[0], addrs[1])
        child = _spawn_child(["ring", name_a, name_b, *addrs])
        reader = RingReader(name_b, 0, addrs[2], addrs[3], attach_timeout=20.0)
        writer.wait_ready(20.0)
        w, r = writer, reader

        def recv() -> bytes:
            frames = r.get_frames(None)
            assert frames is not None
            return bytes(frames[0])

        tr = _Transport(lambda msg: w.put_frames([msg]), recv)
        result = _measure(tr, "ring", size, round_trips, messages)
        result.update(_idle_cpu(tr, idle_s))
        return result
    finally:
        if child is not None:
            _stop(child, tr)
        if reader is not None:
            reader.close()
        if writer is not None:
            writer.close()
        for name in (name_a, name_b):  # the crash case: a killed echo process leaves b behind
            unlink_segment(name)
        for addr in addrs:
            unlink_ipc_file(addr)


def _bench_zmq(tmp: str, size: int, round_trips: int, messages: int) -> dict[str, float]:
    out_addr, in_addr = f"ipc://{tmp}/z_out", f"ipc://{tmp}/z_in"
    ctx = zmq.Context(io_threads=1)
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    child: subprocess.Popen[bytes] | None = None
    tr: _Transport | None = None
    try:
        push.bind(out_addr)
        pull.bind(in_addr)
        child = _spawn_child(["zmq", out_addr, in_addr])
        tr = _Transport(push.send, pull.recv)
        return _measure(tr, "zmq ipc", size, round_trips, messages)
    finally:
        if child is not None:
            _stop(child, tr)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        for addr in (out_addr, in_addr):
            unlink_ipc_file(addr)


def _report(figures: dict[str, Any]) -> str:
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
            "ring": _bench_ring(tmp, args.size, args.round_trips, args.messages,
                                args.idle_seconds),
            "zmq_ipc": _bench_zmq(tmp, args.size, args.round_trips, args.messages),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(_report(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
