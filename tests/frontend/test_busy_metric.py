"""tandem_process_busy_seconds_total follows the scheduler's cumulative busy seconds, and a
new set of roles (counting from 0 again) does not make it go backwards."""
from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from tandem_serve.frontend import metrics
from tandem_serve.proto.monitor_messages import EngineStats


def busy(process: str) -> float:
    return REGISTRY.get_sample_value("tandem_process_busy_seconds_total",
                                     {"process": process}) or 0.0


def report(worker: float, postproc: float) -> EngineStats:
    return EngineStats(10, 10, 0, 0, 0, 0, 0, 0, 0, uptime_s=100.0, worker_busy_s=worker,
                       postproc_busy_s=postproc)


def test_busy_seconds_count_up_across_a_new_set() -> None:
    w0, p0 = busy("gpu-worker"), busy("postproc")
    metrics._busy_seen.clear()
    metrics.on_stats(report(2.0, 0.5))
    metrics.on_stats(report(3.5, 0.75))
    assert busy("gpu-worker") - w0 == pytest.approx(3.5)
    assert busy("postproc") - p0 == pytest.approx(0.75)
    metrics.on_stats(report(1.0, 0.25))  # a replaced set: its totals start again
    assert busy("gpu-worker") - w0 == pytest.approx(4.5)
    assert busy("postproc") - p0 == pytest.approx(1.0)
