"""Where a client's stall came from: the server's own record of the same served round.

A gap a client sees is the gpu worker's gap between the two steps plus how much longer the
second token took to reach the client (postproc worker, frontend, gRPC, the client itself).
With `--profile` every served round is recorded (`tandem profile`'s spans, DESIGN.md section
6) and set beside the client's figures: the gpu worker's own step gaps on the wall clock (its
forward spans' ends, over the same window; on CUDA a forward span is the launch, so this is a
CPU tool) and the longest collection (`gc0`-`gc2` span) of each process.  Where
the client's worst gap matches the worker's, the step itself was late (in-process figures: the
step's own work; what the wall clock adds: the worker waiting for its core); where it does not,
the delivery path held the token.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem_serve.bench.stall.scenario import GapRatios
from tandem_serve.ipc.tracing import GC_SPANS


@dataclass
class ServerSide(GapRatios):
    """The gpu worker's step gaps inside the window, and collector pauses, of one round; and
    how busy the host was (`HostMeter`): on a shared machine a stall is as often a neighbour's
    job on the worker's core as ours."""

    median_gap_ms: float
    p99_gap_ms: float
    worst_gap_ms: float
    num_gaps: int
    gc_ms: dict[str, float] = field(default_factory=dict)  # role -> its longest gc span
    worker_wait_pct: float = -1.0  # the worker's main thread runnable, not running (-1: unknown)
    others_cpu_pct: float = -1.0  # CPU of every other process on the host, % of one core



class Recorder:
    """Records the server's spans for `seconds` on a thread, beside a round of the scenario."""

    def __init__(self, port: int, seconds: float) -> None:
        self.profiles: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._record, args=(port, seconds))

    def _record(self, port: int, seconds: float) -> None:
        from tandem_serve.tandem.profile_cli import record

        try:
            self.profiles = record("127.0.0.1", port, seconds).profiles
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()

    def result(self) -> list[dict[str, Any]]:
        if self.error is not None:
            raise RuntimeError(f"recording the served round failed: {self.error}")
        return self.profiles


def server_side(profiles: list[dict[str, Any]], window: tuple[float, float]) -> ServerSide:
    """The worker's step gaps that end inside `window` (time.monotonic seconds, the client's
    clock: CLOCK_MONOTONIC, the spans' too), and each process's longest gc span in it."""
    lo, hi = (int(t * 1e9) for t in window)
    worker = next(p for p in profiles if p["role"] == "gpu-worker")
    ends = np.array(sorted(e for name, _, e, _, _ in worker["spans"] if name == "forward"))
    inside = (ends[1:] >= lo) & (ends[1:] <= hi)
    gaps = np.diff(ends)[inside] / 1e6
    if not len(gaps):
        raise RuntimeError("the recording holds no steps inside the measured window")
    pauses: dict[str, float] = {}
    for p in profiles:
        spans = [(e - s) / 1e6 for name, s, e, _, _ in p["spans"]
                 if name in GC_SPANS and lo <= e and s <= hi]
        pauses[p["role"]] = max(spans, default=0.0)
    return ServerSide(median_gap_ms=float(np.median(gaps)),
                      p99_gap_ms=float(np.percentile(gaps, 99)),
                      worst_gap_ms=float(gaps.max()), num_gaps=len(gaps), gc_ms=pauses)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _tree(root: int) -> list[int]:
    """`root` and its descendants (the server's processes), from /proc."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parents[int(name)] = int(_stat(int(name))[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def _worker_pid(pids: list[int]) -> int | None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
        except OSError:
            continue
        if b"gpu-worker" in line:  # its title ("tandem: gpu-worker"), or `run-role gpu-worker`
            return pid
    return None


class HostMeter:
    """Over one served round (Linux /proc; figures stay -1 elsewhere): how long the gpu
    worker's main thread waited for a core while runnable (its schedstat run delay, % of the
    round), and how much CPU every process outside the server and this benchmark used (all
    cores' busy time less ours, % of one core)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.worker_wait_pct = -1.0
        self.others_cpu_pct = -1.0

    def _sample(self) -> tuple[float, int, int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()[1:]
            # user nice system (idle iowait) irq softirq steal
            busy = sum(int(x) for x in fields[:3]) + sum(int(x) for x in fields[5:8])
            ours = 0
            for pid in [*self._pids, os.getpid()]:
                try:
                    st = _stat(pid)
                    ours += int(st[11]) + int(st[12])
                except (OSError, IndexError):
                    pass
            wait = 0
            if self._worker is not None:
                with open(f"/proc/{self._worker}/schedstat") as f:
                    wait = int(f.read().split()[1])
            return time.monotonic(), busy, ours, wait
        except (OSError, IndexError, ValueError):
            return None

    def __enter__(self) -> HostMeter:
        try:
            self._pids = _tree(self.server_pid)
        except OSError:
            self._pids = []
        self._worker = _worker_pid(self._pids)
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._sample()
        if self._start is None or end is None:
            return
        seconds = end[0] - self._start[0]
        others = end[1] - self._start[1] - (end[2] - self._start[2])  # ticks of ~10 ms
        self.others_cpu_pct = max(0.0, 100.0 * others / _TICK / seconds)
        if self._worker is not None:
            self.worker_wait_pct = 100.0 * (end[3] - self._start[3]) / 1e9 / seconds
