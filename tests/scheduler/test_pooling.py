"""The pooling queue: batches in arrival order under the padded-token budget and the row
limit, at most two at the worker, aborts of waiting requests, admission control."""
from __future__ import annotations

import numpy as np

from tandem_serve.proto.pooling_messages import PoolDone, PoolRequest
from tandem_serve.scheduler.pooling import AHEAD, PoolingParams, PoolScheduler


def req(rid: int, n: int) -> PoolRequest:
    return PoolRequest(rid, np.arange(n, dtype=np.int32), np.zeros(0, np.int32), 0.0)


def test_batches_by_padded_tokens_rows_and_order() -> None:
    s = PoolScheduler(PoolingParams(max_num_seqs=3, max_batch_tokens=40, max_queued_requests=9))
    for rid, n in enumerate([10, 10, 5, 30, 2, 2, 2, 50]):
        assert s.add(req(rid, n)) is None
    first = s.build_plan()
    assert [r.request_id for r in first.requests] == [0, 1, 2]  # 3 rows x 10 = 30 <= 40
    assert s.ready_to_plan()
    second = s.build_plan()
    assert [r.request_id for r in second.requests] == [3]  # 2 rows x 30 = 60 > 40
    assert not s.ready_to_plan()  # two batches at the worker: the next waits
    assert len(s.in_flight) == AHEAD
    stats = s.stats()  # vLLM's running / waiting gauges, the queue-time histogram
    assert (stats.num_running, stats.num_waiting, len(stats.queue_times_s)) == (4, 4, 4)
    assert s.stats().queue_times_s == []  # each reported once
    s.on_done(PoolDone(first.plan_id, 3, 25, 0.01))
    assert [r.request_id for r in s.build_plan().requests] == [4, 5, 6]  # the row limit
    s.on_done(PoolDone(second.plan_id, 1, 30, 0.01))
    assert [r.request_id for r in s.build_plan().requests] == [7]  # over budget alone: runs
    assert (s.num_requests, s.num_tokens) == (4, 55)


def test_aborted_waiting_requests_never_run_and_admission() -> None:
    s = PoolScheduler(PoolingParams(max_num_seqs=8, max_batch_tokens=100, max_queued_requests=3))
    for rid in range(3):
        s.add(req(rid, 4))
    rejected = s.add(req(3, 4))
    assert rejected is not None and "--max-queued-requests" in rejected.message
    s.abort(0)
    s.abort(2)
    s.abort(99)  # unknown or already sent: nothing to do
    assert [r.request_id for r in s.build_plan().requests] == [1]
    assert not s.ready_to_plan()
