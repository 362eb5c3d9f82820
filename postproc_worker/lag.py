"""How far a postproc worker runs behind the gpu worker (`lag_steps`), as the profile's
counter and the frontend's gauge (`PostprocStats`)."""
from __future__ import annotations

from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto.monitor_messages import PostprocStats

STATS_INTERVAL = 0.2  # seconds between PostprocStats at most, as the scheduler's EngineStats


class LagMeter:
    """How many steps this worker runs behind the gpu worker, measured after each token batch:
    the batches published and not yet processed.  A `lag_steps` counter in the profile, and the
    most over each interval to the frontend's gauge."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.peak = 0  # the most since the previous report
        self.sent = 0  # the frontend's gauge starts at 0
        self.sent_at = 0.0

    def observe(self, lag: int) -> None:
        TRACER.counter("lag_steps", lag)
        self.peak = max(self.peak, lag)

    def report(self, now: float) -> PostprocStats | None:
        """The interval's peak when one has ended and it differs from the last one sent."""
        if now - self.sent_at < STATS_INTERVAL:
            return None
        peak, self.peak, self.sent_at = self.peak, 0, now
        if peak == self.sent:
            return None
        self.sent = peak
        return PostprocStats(self.index, peak)
