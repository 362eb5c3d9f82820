"""Where a client's stall came from: the server's own record of the same served round.

A gap a client sees is the gpu worker's gap between the two steps plus how much longer the
second token took to reach the client (postproc worker, frontend, gRPC, the client itself).
With `--profile` every served round is recorded (`tandem profile`'s spans, DESIGN.md section
6) and set beside the client's figures: the gpu worker's own step gaps on the wall clock (its
forward spans' ends, over the same window; on CUDA a forward span is the launch, so this is a
CPU tool) and the longest `gc` span of each process.  Where
the client's worst gap matches the worker's, the step itself was late (in-process figures: the
step's own work; what the wall clock adds: the worker waiting for its core); where it does not,
the delivery path held the token.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ServerSide:
    """The gpu worker's step gaps inside the window, and collector pauses, of one round."""

    median_gap_ms: float
    p99_gap_ms: float
    worst_gap_ms: float
    num_gaps: int
    gc_ms: dict[str, float] = field(default_factory=dict)  # role -> its longest gc span

    @property
    def worst_ratio(self) -> float:
        return self.worst_gap_ms / self.median_gap_ms

    @property
    def p99_ratio(self) -> float:
        return self.p99_gap_ms / self.median_gap_ms


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
                 if name == "gc" and lo <= e and s <= hi]
        pauses[p["role"]] = max(spans, default=0.0)
    return ServerSide(median_gap_ms=float(np.median(gaps)),
                      p99_gap_ms=float(np.percentile(gaps, 99)),
                      worst_gap_ms=float(gaps.max()), num_gaps=len(gaps), gc_ms=pauses)
