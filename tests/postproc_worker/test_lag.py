"""The postproc worker's lag: a profile counter per batch, an on-change report per interval."""
from __future__ import annotations

from tandem_serve.ipc.tracing import TRACER
from tandem_serve.postproc_worker.lag import STATS_INTERVAL, LagMeter
from tandem_serve.proto.monitor_messages import PostprocStats


def test_reports_the_interval_peak_only_when_it_changes() -> None:
    lag = LagMeter(1)
    assert lag.report(10.0) is None  # nothing seen: the gauge's 0 stands
    for n in (2, 5, 1):
        lag.observe(n)
    assert lag.report(10.0 + STATS_INTERVAL / 2) is None  # interval not over
    assert lag.report(10.0 + 1.5 * STATS_INTERVAL) == PostprocStats(1, 5)
    lag.observe(5)
    assert lag.report(10.0 + 3 * STATS_INTERVAL) is None  # unchanged
    assert lag.report(10.0 + 4.5 * STATS_INTERVAL) == PostprocStats(1, 0)  # caught up


def test_each_observation_is_a_profile_counter() -> None:
    TRACER.start()
    try:
        LagMeter(0).observe(3)
    finally:
        data = TRACER.stop()
    assert [(c[0], c[2]) for c in data["counters"]] == [("lag_steps", 3)]
