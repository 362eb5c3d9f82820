"""Span recording, one `Tracer` per process, on the host-wide monotonic clock.

Off by default: `span()` then returns one shared no-op context manager, so an
instrumented loop pays an attribute check and a call.  On, each span is a tuple appended
to a bounded deque.  `time.monotonic_ns()` is CLOCK_MONOTONIC, the same clock in every
process of a host, so spans from different processes line up without any translation.
"""
from __future__ import annotations

import collections
import gc
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandem_serve.ipc.channels import Sender
    from tandem_serve.proto.monitor_messages import ProfileControl

MAX_SPANS = 500_000

# (name, start_ns, end_ns, plan, step).  A span outside any plan (plan -1) may name a request
# in the last field instead: the frontend's spans carry the request id there.
Span = tuple[str, int, int, int, int]


class _NoSpan(AbstractContextManager):
    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class _Span(AbstractContextManager):
    __slots__ = ("_tracer", "_name", "_plan", "_step", "_start")

    def __init__(self, tracer: Tracer, name: str, plan: int, step: int) -> None:
        self._tracer, self._name, self._plan, self._step = tracer, name, plan, step
        self._start = time.monotonic_ns()

    def __exit__(self, *exc: object) -> None:
        self._tracer.spans.append((self._name, self._start, time.monotonic_ns(), self._plan,
                                   self._step))


@dataclass
class ProfileWindow:
    """When a recording ends: after `plans` plans (0: no count) or at `deadline_ns` (0: none),
    whichever comes first.  The gpu worker counts plans; the frontend keeps the deadline."""

    plans: int = 0
    deadline_ns: int = 0
    plans_done: int = 0

    def count_plan(self) -> bool:
        """One more plan finished inside the window; True when that completes the count."""
        self.plans_done += 1
        return 0 < self.plans <= self.plans_done


class Tracer:
    def __init__(self, role: str) -> None:
        self.role = role
        self.enabled = False
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self.counters: collections.deque[tuple[str, int, float]] = collections.deque(
            maxlen=MAX_SPANS)
        self.started_ns = 0
        self.stopped_ns = 0
        self.window = ProfileWindow()

    def span(self, name: str, plan: int = -1, step: int = -1) -> AbstractContextManager:
        if not self.enabled:
            return _NO_SPAN
        return _Span(self, name, plan, step)

    def record(self, name: str, start_ns: int, end_ns: int, plan: int = -1,
               step: int = -1) -> None:
        if self.enabled:
            # A span measured from before the start (idle since ...) begins with the window,
            # so every span lies inside [started_ns, stopped_ns].
            self.spans.append((name, max(start_ns, self.started_ns), end_ns, plan, step))

    def counter(self, name: str, value: float) -> None:
        if self.enabled:
            self.counters.append((name, time.monotonic_ns(), value))

    def start(self, window: ProfileWindow | None = None) -> None:
        self.spans.clear()
        self.counters.clear()
        self.window = window or ProfileWindow()
        self.started_ns = time.monotonic_ns()
        self.stopped_ns = 0
        self.enabled = True

    def count_plan(self) -> bool:
        """A plan finished: True when it was the window's last (recording should stop)."""
        return self.enabled and self.window.count_plan()

    def stop(self) -> dict[str, Any]:
        """Stop and hand over everything recorded, as plain lists (msgpack-friendly)."""
        self.enabled = False
        self.stopped_ns = time.monotonic_ns()
        data = {
            "role": self.role,
            "started_ns": self.started_ns,
            "stopped_ns": self.stopped_ns,
            "spans": [list(s) for s in self.spans],
            "counters": [list(c) for c in self.counters],
            "plans": self.window.plans_done,
        }
        self.spans.clear()
        self.counters.clear()
        return data


# One per process: the process's main module sets the role at start-up.
TRACER = Tracer("process")
GC_SPANS = ("gc0", "gc1", "gc2")  # a collection of generation 0, 1, 2 (a full one)


class _GcSpans:
    """A span for every collection while recording, named by its generation (`gc0`, `gc1`,
    `gc2`: a full one): a pause of the interpreter's cyclic collector holds up whatever the
    process was doing (a full collection of ~40k objects costs 5-40 ms), so the timeline
    shows it by name.  A collection runs inside the code that allocated, so its span nests in
    that code's.  No plan or request: both fields are -1."""

    def __init__(self) -> None:
        self.started = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not TRACER.enabled:
            return
        if phase == "start":
            self.started = time.monotonic_ns()
        elif self.started:
            TRACER.record(GC_SPANS[info["generation"]], self.started, time.monotonic_ns())
            self.started = 0


gc.callbacks.append(_GcSpans())


def set_role(role: str) -> Tracer:
    TRACER.role = role
    return TRACER


class ProfileExtra(Protocol):
    """More recording over the same window (the gpu worker's torch.profiler)."""

    def start(self, msg: ProfileControl) -> None: ...

    def stop(self) -> tuple[str, str]:
        """Finish; (file written, error), either may be ""."""
        ...


def on_profile_control(msg: ProfileControl, reply: Sender,
                       extra: ProfileExtra | None = None) -> None:
    """What every process does with a ProfileControl from the frontend."""
    if msg.start:
        TRACER.start(ProfileWindow(plans=msg.plans))
        if extra is not None:
            extra.start(msg)
    elif TRACER.enabled:
        _send_profile(reply, extra)
    # else: the window already ended by its plan count and the data went out unasked; the
    # frontend's stop crossed it on the way.


def on_plan_done(reply: Sender, extra: ProfileExtra | None = None) -> None:
    """gpu worker, after each plan: the window's last plan ends the recording right here, so
    it holds exactly that many whole plans, and the data goes to the frontend unasked."""
    if TRACER.count_plan():
        _send_profile(reply, extra)


def _send_profile(reply: Sender, extra: ProfileExtra | None) -> None:
    from tandem_serve.proto.monitor_messages import ProfileData

    data = TRACER.stop()
    torch_trace, torch_error = extra.stop() if extra is not None else ("", "")
    reply.put(ProfileData(data["role"], data["started_ns"], data["stopped_ns"], data["spans"],
                          data["counters"], data["plans"], torch_trace, torch_error))
