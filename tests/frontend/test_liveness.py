"""GET /live's judgement (frontend/liveness.py) over scripted scheduler reports."""
from __future__ import annotations

from tandem_serve.frontend.liveness import Liveness
from tandem_serve.proto.monitor_messages import EngineStats


def report(plans: int, running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(100, 100, running, waiting, 0, 0, 0, 0, 0, num_plans=plans)


def test_idle_is_live_however_long() -> None:
    live = Liveness(5.0, now=0.0)
    live.on_stats(report(3), now=1.0)
    assert live.stalled_for(0, now=1000.0) is None


def test_idle_time_does_not_count_against_the_next_request() -> None:
    live = Liveness(5.0, now=0.0)
    for t in range(100):  # an idle hundred seconds of reports, plans unchanged
        live.on_stats(report(3), now=float(t))
    live.on_stats(report(3, running=1), now=100.0)  # a request arrives
    assert live.stalled_for(1, now=104.0) is None
    assert live.stalled_for(1, now=105.5) == 6.5


def test_completed_plans_keep_it_live_and_their_end_is_noticed() -> None:
    live = Liveness(5.0, now=0.0)
    for t in range(20):
        live.on_stats(report(t, running=1), now=float(t))
    assert live.stalled_for(1, now=22.0) is None
    for t in range(20, 30):  # stuck: the count stops moving with work queued
        live.on_stats(report(19, running=1, waiting=2), now=float(t))
    assert live.stalled_for(1, now=29.0) == 10.0
    assert live.stalled_for(0, now=29.0) == 10.0  # the scheduler still holds work
    assert live.first_word() and not live.first_word()  # one log line per stall
    live.on_stats(report(20, running=1), now=30.0)
    assert live.stalled_for(1, now=30.0) is None
    assert live.first_word()  # a new stall is news again


def test_a_silent_scheduler_with_open_requests_is_not_live() -> None:
    live = Liveness(5.0, now=0.0)
    live.on_stats(report(4), now=1.0)  # its last report: idle, then nothing more
    assert live.stalled_for(1, now=5.9) is None
    assert live.stalled_for(1, now=7.0) == 6.0
    assert live.stalled_for(0, now=7.0) is None  # with nothing open there is nothing to do


def test_a_slow_reader_is_no_stall() -> None:
    live = Liveness(5.0, now=0.0)
    for t in range(20):  # the engine finished; a client still reads its output
        live.on_stats(report(8), now=float(t))
    assert live.stalled_for(1, now=20.0) is None


def test_a_new_set_of_roles_starts_its_count_again() -> None:
    live = Liveness(5.0, now=0.0)
    live.on_stats(report(50, running=1), now=1.0)
    live.reset(now=2.0)
    live.on_stats(report(0, running=1), now=3.0)  # a count below the old one is progress too
    assert live.stalled_for(1, now=7.5) is None
