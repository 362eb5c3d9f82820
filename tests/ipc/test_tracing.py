"""A process's side of `tandem profile`: start, stop, and the gpu worker's plan-count window."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tandem_serve.ipc import tracing
from tandem_serve.ipc.tracing import TRACER
from tandem_serve.proto.monitor_messages import ProfileControl, ProfileData


class Inbox:
    """Stands in for the Sender to the frontend."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def put(self, msg: object) -> None:
        self.sent.append(msg)


class FakeExtra:
    def __init__(self) -> None:
        self.started: list[ProfileControl] = []
        self.stops = 0

    def start(self, msg: ProfileControl) -> None:
        self.started.append(msg)

    def stop(self) -> tuple[str, str]:
        self.stops += 1
        return "/tmp/t.json", ""


@pytest.fixture(autouse=True)
def worker_role() -> Iterator[None]:
    role = TRACER.role
    tracing.set_role("gpu-worker")
    yield
    TRACER.enabled = False
    TRACER.role = role


def run_plan(plan: int, reply: Inbox, extra: FakeExtra | None = None) -> None:
    with TRACER.span("forward", plan, 0):
        pass
    tracing.on_plan_done(reply, extra)  # type: ignore[arg-type]


def test_plan_count_stops_recording_and_sends_unasked() -> None:
    reply, extra = Inbox(), FakeExtra()
    tracing.on_profile_control(ProfileControl(True, plans=3, torch_trace="/tmp/t.json"),
                               reply, extra)  # type: ignore[arg-type]
    assert extra.started[0].torch_trace == "/tmp/t.json"
    for plan in range(5):
        run_plan(plan, reply, extra)
    (data,) = reply.sent
    assert isinstance(data, ProfileData)
    assert data.plans == 3 and data.torch_trace == "/tmp/t.json" and extra.stops == 1
    assert sorted({s[3] for s in data.spans}) == [0, 1, 2]  # exactly the window's plans
    # The frontend's stop crossed the data on its way: nothing more is sent.
    tracing.on_profile_control(ProfileControl(False), reply)  # type: ignore[arg-type]
    assert len(reply.sent) == 1


def test_without_a_count_the_stop_ends_the_window() -> None:
    reply = Inbox()
    tracing.on_profile_control(ProfileControl(True), reply)  # type: ignore[arg-type]
    for plan in range(4):
        run_plan(plan, reply)
    assert not reply.sent
    tracing.on_profile_control(ProfileControl(False), reply)  # type: ignore[arg-type]
    (data,) = reply.sent
    assert isinstance(data, ProfileData) and data.plans == 4 and len(data.spans) == 4
    assert data.torch_trace == "" and data.started_ns <= data.stopped_ns


def test_plans_outside_a_window_count_nothing() -> None:
    reply = Inbox()
    run_plan(0, reply)
    assert not reply.sent and not TRACER.enabled


def test_a_span_measured_from_before_the_start_begins_with_the_window() -> None:
    before = time.monotonic_ns()
    TRACER.start()
    TRACER.record("idle", before, time.monotonic_ns(), 7)
    data = TRACER.stop()
    (span,) = data["spans"]
    assert data["started_ns"] == span[1] <= span[2] <= data["stopped_ns"]


def test_window_counts_plans() -> None:
    w = tracing.ProfileWindow(plans=2)
    assert not w.count_plan() and w.count_plan() and w.plans_done == 2
    assert not tracing.ProfileWindow().count_plan()  # no count: never ends by itself


def test_a_collection_is_a_span_named_by_its_generation_only_while_recording() -> None:
    import gc

    gc.collect()
    TRACER.start()
    gc.collect()  # a full one: generation 2 in the step field
    data = TRACER.stop()
    spans = [s for s in data["spans"] if s[0].startswith("gc")]
    assert spans and spans[-1][0] == "gc2" and spans[-1][3:] == [-1, -1]
    assert data["started_ns"] <= spans[-1][1] <= spans[-1][2] <= data["stopped_ns"]
    gc.collect()  # not recording: nothing kept
    assert not TRACER.spans
