"""`GET /live`: does the engine still make progress while it has work?

A wedged engine (a hung kernel, a stuck scheduler) leaves the frontend's event loop
answering, so a probe of any endpoint the loop serves says "alive" forever. What only a
working engine produces is completed plans: the scheduler counts the gpu worker's StepDone
messages and reports the count (`EngineStats.num_plans`) with its queue lengths every 0.2 s.

Live means: no work (no open request, nothing running or waiting in the last report), or a
plan completed within `--liveness-timeout` seconds. Idle time never counts against the engine:
every report with nothing running or waiting restarts the clock, so the first request after
an idle hour has the whole timeout, and a slow client still reading its output is no stall.
A scheduler that stops reporting stops the clock too, and a frontend with open requests then
turns not live, as it should. Draining changes nothing: a draining
server whose plans still complete is live (and must not be killed in its drain), one whose
engine is stuck is not.
"""
from __future__ import annotations

from tandem_serve.proto.monitor_messages import EngineStats


class Liveness:
    """The last sign of progress, fed with the scheduler's reports (`time.monotonic()`)."""

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self._plans = -1
        self._busy = False  # the last report had requests running or waiting
        self._progress_at = now  # the last completed plan, or the last report of no work
        self._said = False  # this stall was logged already

    def on_stats(self, stats: EngineStats, now: float) -> None:
        self._busy = bool(stats.num_running or stats.num_waiting)
        if stats.num_plans != self._plans:
            self._plans = stats.num_plans
            self._progress_at = now
            self._said = False
        elif not self._busy:  # nothing to do (a client still reading its output is no work)
            self._progress_at = now
            self._said = False

    def reset(self, now: float) -> None:
        """A new set of roles (roles on their own): its plan count starts again."""
        self._plans = -1
        self._busy = False
        self._progress_at = now

    def stalled_for(self, open_requests: int, now: float) -> float | None:
        """Seconds without progress while there was work, once past the timeout; else None.

        Work is an open request of ours, or requests the scheduler last reported (one whose
        client went away is still the engine's to finish)."""
        if not (open_requests or self._busy):
            return None
        stalled = now - self._progress_at
        return stalled if stalled > self.timeout else None

    def first_word(self) -> bool:
        """True once per stall: the first 503 is logged, not every probe's."""
        said, self._said = self._said, True
        return not said
