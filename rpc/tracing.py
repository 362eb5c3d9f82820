"""Span recording, one `Tracer` per process, on the host-wide monotonic clock.

Off by default: `span()` then returns one shared no-op context manager, so an
instrumented loop pays an attribute check and a call.  On, each span is a tuple appended
to a bounded deque.  `time.monotonic_ns()` is CLOCK_MONOTONIC, the same clock in every
process of a host, so spans from different processes line up without any translation.
"""
from __future__ import annotations

import collections
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proto.messages import ProfileControl
    from rpc.channels import Sender

MAX_SPANS = 500_000

# (name, start_ns, end_ns, plan, step)
Span = tuple[str, int, int, int, int]


class _NoSpan(AbstractContextManager):
    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class _Span(AbstractContextManager):
    __slots__ = ("_tracer", "_name", "_plan", "_step", "_start")

    def __init__(self, tracer: "Tracer", name: str, plan: int, step: int) -> None:
        self._tracer, self._name, self._plan, self._step = tracer, name, plan, step
        self._start = time.monotonic_ns()

    def __exit__(self, *exc: object) -> None:
        self._tracer.spans.append((self._name, self._start, time.monotonic_ns(), self._plan,
                                   self._step))


@dataclass
class ProfileWindow:
    """When to stop recording: after `plans` plans or at `deadline_ns`, whichever is first."""

    plans: int = 0
    deadline_ns: int = 0


class Tracer:
    def __init__(self, role: str) -> None:
        self.role = role
        self.enabled = False
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self.counters: collections.deque[tuple[str, int, float]] = collections.deque(
            maxlen=MAX_SPANS)
        self.started_ns = 0
        self.stopped_ns = 0

    def span(self, name: str, plan: int = -1, step: int = -1) -> AbstractContextManager:
        if not self.enabled:
            return _NO_SPAN
        return _Span(self, name, plan, step)

    def record(self, name: str, start_ns: int, end_ns: int, plan: int = -1,
               step: int = -1) -> None:
        if self.enabled:
            self.spans.append((name, start_ns, end_ns, plan, step))

    def counter(self, name: str, value: float) -> None:
        if self.enabled:
            self.counters.append((name, time.monotonic_ns(), value))

    def start(self) -> None:
        self.spans.clear()
        self.counters.clear()
        self.started_ns = time.monotonic_ns()
        self.stopped_ns = 0
        self.enabled = True

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
        }
        self.spans.clear()
        self.counters.clear()
        return data


# One per process: the process's main module sets the role at start-up.
TRACER = Tracer("process")


def set_role(role: str) -> Tracer:
    TRACER.role = role
    return TRACER


def on_profile_control(msg: "ProfileControl", reply: "Sender") -> None:
    """What every process does with a ProfileControl from the frontend."""
    from proto.messages import ProfileData

    if msg.start:
        TRACER.start()
    else:
        data = TRACER.stop()
        reply.put(ProfileData(data["role"], data["started_ns"], data["stopped_ns"],
                              data["spans"], data["counters"]))
