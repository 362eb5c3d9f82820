"""What `tandem bench ipc` measures over either transport: round trips, one-way throughput
and an idle reader's CPU, each against an echo process (`echo.py`)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import zmq

from tandem_serve.bench.ipc.echo import COUNT, ECHO, IDLE, IDLE_END, QUIT, TALLY
from tandem_serve.harness.processes import REPO_ROOT
from tandem_serve.harness.stats import percentile
from tandem_serve.ipc.shm_ring import RingReader, RingWriter, unlink_ipc_file, unlink_segment


def _spawn_child(args: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    code = ("import sys; from tandem_serve.bench.ipc.echo import child_main; "
            "sys.exit(child_main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env)


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
    tr.send(TALLY)
    reply = tr.recv()
    elapsed = time.perf_counter() - start
    progress.update(count)
    got = int(reply[1:])
    if got != count:
        raise RuntimeError(f"{label}: the echo process counted {got} of {count} messages")
    return elapsed


def _measure(tr: _Transport, name: str, size: int, round_trips: int,
             messages: int) -> dict[str, float]:
    echo = ECHO + b"x" * (size - 1)
    count = COUNT + b"x" * (size - 1)
    print(f"[{name}] round trips", file=sys.stderr, flush=True)
    samples = _round_trips(tr, echo, round_trips, min(2000, round_trips), f"{name} round trip")
    print(f"[{name}] one-way throughput", file=sys.stderr, flush=True)
    elapsed = _one_way(tr, count, messages, f"{name} one-way")
    return {
        "rt_p50_us": percentile(samples, 50) / 1000.0,
        "rt_p99_us": percentile(samples, 99) / 1000.0,
        "rt_mean_us": statistics.fmean(samples) / 1000.0,
        "oneway_msgs_per_s": messages / elapsed,
        "oneway_mb_per_s": messages * size / elapsed / 1e6,
    }


def _idle_cpu(tr: _Transport, seconds: float) -> dict[str, float]:
    print(f"[ring] idle reader for {seconds:g} s", file=sys.stderr, flush=True)
    tr.send(IDLE)
    time.sleep(seconds)
    tr.send(IDLE_END)
    stats = json.loads(tr.recv()[1:])
    return {"idle_seconds": stats["wall_s"], "idle_cpu_s": stats["cpu_s"],
            "idle_cpu_pct": 100.0 * stats["cpu_s"] / stats["wall_s"]}


def _stop(child: subprocess.Popen[bytes], tr: _Transport | None) -> None:
    if tr is not None and child.poll() is None:
        try:
            tr.send(QUIT)
            child.wait(5)
        except Exception:  # the echo process is already broken; the kill below settles it
            pass
    if child.poll() is None:
        child.kill()
        child.wait()


def bench_ring(tmp: str, size: int, round_trips: int, messages: int,
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


def bench_zmq(tmp: str, size: int, round_trips: int, messages: int) -> dict[str, float]:
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
