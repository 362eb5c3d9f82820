"""The arm loop the serving benchmarks share: an arm is one server configuration (K,
sync/async, paced, gRPC or HTTP); arms take turns over repeats, each measured between two
readings of the engine's counters and of every process's CPU time."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from tandem_serve.harness.processes import CpuMeter
from tandem_serve.harness.server import Served, engine_counters, serving

T = TypeVar("T")
# The scheduler reports its counters every 0.2 s: wait longer before reading them.
COUNTERS_SETTLE_S = 0.5
ARM_READY_TIMEOUT_S = 180.0


@dataclasses.dataclass(frozen=True)
class Arm:
    steps: int
    async_mode: bool
    paced: bool = True  # async only: --pace-plans (the default) or --no-pace-plans
    http: bool = False  # driven over the OpenAI-compatible HTTP API instead of gRPC
    # Each plan's prefill in a forward of its own before its steps (the baseline of mixed
    # steps, where prefill pieces ride inside the decode steps).
    prefill_phase: bool = False

    @property
    def name(self) -> str:
        mode = "sync" if not self.async_mode else "async" if self.paced else "async unpaced"
        return (f"{mode} K={self.steps}" + (" prefill-phase" if self.prefill_phase else "")
                + (" HTTP" if self.http else ""))

    @property
    def flags(self) -> list[str]:
        """The `tandem serve` flags of this arm."""
        return ["--num-scheduler-steps", str(self.steps),
                "--async-postproc" if self.async_mode else "--no-async-postproc",
                "--pace-plans" if self.paced else "--no-pace-plans",
                *(["--prefill-phase"] if self.prefill_phase else [])]


@contextlib.contextmanager
def arm_server(model: str, arm: Arm, extra: list[str]) -> Iterator[Served]:
    """A fresh `tandem serve` for one arm, SERVING on a free port (and, for an HTTP arm, a
    free HTTP port); stopped on exit."""
    with serving(model, [*arm.flags, *extra], http=arm.http, quiet=True,
                 timeout=ARM_READY_TIMEOUT_S) as served:
        yield served


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


def rounds(arms: Sequence[T], repeats: int) -> Iterator[tuple[int, list[T]]]:
    """Each repeat's order of the arms: reversed every other repeat, so a slow drift of the
    machine does not favour one side."""
    for rep in range(repeats):
        yield rep, list(arms) if rep % 2 == 0 else list(arms)[::-1]


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


class Load(Protocol):
    """A workload an arm runs (`bench.serve.workload.Workload`): it warms the target up,
    calls `warmed()` (given among `changes`), then runs and returns the result dict."""

    def run(self, **changes: Any) -> dict[str, Any]: ...


def run_arm(model: str, arm: Arm, work: Load, extra: list[str],
            after: Callable[[int], None] | None = None) -> dict[str, Any]:
    """`work` against a fresh server of `arm`: its result with the engine's figures and the
    CPU seconds per process over the measured part; then `after(port)` on the same server
    while it still runs."""
    with arm_server(model, arm, extra) as served:
        start: dict[str, Any] = {}

        def warmed() -> None:
            time.sleep(COUNTERS_SETTLE_S)
            start["counters"] = engine_counters(served.client)
            start["meter"] = CpuMeter(served.proc.pid)

        target: dict[str, Any] = dict(port=served.port)
        if arm.http:
            target = dict(backend="openai-completions", port=served.http_port,
                          base_url=f"http://127.0.0.1:{served.http_port}")
        with beside_frontend(served.proc.pid):
            result = work.run(model=model, warmed=warmed, **target)
        result["cpu_s"] = start["meter"].stop()
        time.sleep(COUNTERS_SETTLE_S)
        result.update(engine_figures(start["counters"], engine_counters(served.client)))
        if after is not None:
            after(served.port)
        return result
