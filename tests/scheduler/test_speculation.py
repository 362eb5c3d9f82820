"""The scheduler's bounds under speculative decoding (`scheduler.speculation`)."""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.scheduler.requests import Request, RequestStatus
from tandem_serve.scheduler.speculation import SpecCounts


def running(rid: int, prompt: int, max_new: int) -> Request:
    req = Request(rid, np.arange(prompt, dtype=np.int32), SamplingParams(max_new_tokens=max_new),
                  0.0, max_model_len=1000)
    req.status, req.num_computed = RequestStatus.RUNNING, prompt - 1
    return req


def test_lookahead_covers_the_upper_bound_within_limits() -> None:
    spec = SpecCounts(3, cache_positions=64)
    req = running(1, prompt=10, max_new=100)
    assert spec.positions(req, 9, 4) == 9 + 16  # K * (k + 1)
    spec.predict(0, req, 4)  # a plan in flight: its slack counts too
    assert spec.positions(req, 13, 4) == 13 + 12 + 16
    assert spec.positions(running(2, 10, 5), 9, 4) == 15  # the request's own limit
    assert spec.positions(running(3, 60, 100), 59, 4) == 64  # never more than the cache
    assert SpecCounts(0, 64).positions(req, 9, 4) == 13


def test_step_done_replaces_bounds_and_recaps_the_plan_in_flight() -> None:
    spec = SpecCounts(3, cache_positions=1000)
    req = running(1, prompt=10, max_new=12)  # finishes at 22 tokens
    for plan in (0, 1):  # plan 1 built before StepDone(0): 4 + 4 tokens at least
        spec.predict(plan, req, 4)
        req.num_tokens += 4
        req.num_computed += 4
    assert not spec.confirmed(req)
    # Plan 0 made 10 tokens: 20 now, so plan 1 can add only 2 before the limit.
    reached = spec.correct(0, {1: 10}, {1: req})
    assert req.num_tokens == 22 and req.num_computed == 21
    assert reached == [req]  # finished by counts inside plan 1
    assert not spec.confirmed(req)
    spec.correct(1, {1: 2}, {1: req})
    assert spec.confirmed(req) and req.num_tokens == 22


def test_a_preempted_request_gets_its_exact_length_and_recomputes_from_zero() -> None:
    spec = SpecCounts(2, cache_positions=1000)
    req = running(1, prompt=10, max_new=50)
    spec.predict(0, req, 3)
    req.num_tokens += 3
    req.status, req.num_computed = RequestStatus.PREEMPTED, 0
    assert spec.correct(0, {1: 7}, {1: req}) == []
    assert req.num_tokens == 17 and req.num_computed == 0 and spec.confirmed(req)
