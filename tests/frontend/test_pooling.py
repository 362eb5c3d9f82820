"""The frontend's pooler: one engine request per input, rows back in input order whatever
order the outputs come in, rejection as its own error, and a caller that goes away aborts
what is still queued."""
from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from tandem_serve.frontend.pooling import Pooler, PoolingRejected
from tandem_serve.proto.pooling_messages import PoolOutput, PoolRequest
from tandem_serve.proto.request_messages import AbortRequest, RequestRejected


def pooler() -> tuple[Pooler, list[object]]:
    sent: list[object] = []
    ids = itertools.count(100)
    return Pooler(sent.append, lambda: next(ids)), sent


def test_rows_in_input_order_and_token_types() -> None:
    async def main() -> np.ndarray:
        p, sent = pooler()
        task = asyncio.create_task(p.run([[1, 2], [3], [4, 5, 6]], [[0, 0], [0], [0, 1, 1]]))
        await asyncio.sleep(0)
        reqs = [m for m in sent if isinstance(m, PoolRequest)]
        assert [r.prompt_ids.tolist() for r in reqs] == [[1, 2], [3], [4, 5, 6]]
        assert reqs[2].token_type_ids.tolist() == [0, 1, 1]
        # The worker answers in two plans, the last request first.
        p.on_output(PoolOutput(np.array([102], np.int64), np.full((1, 2), 3, np.float32)))
        p.on_output(PoolOutput(np.array([100, 101], np.int64),
                               np.array([[1, 1], [2, 2]], np.float32)))
        rows = await task
        assert p.num_in_flight == 0
        return rows

    assert asyncio.run(main()).tolist() == [[1, 1], [2, 2], [3, 3]]


def test_rejection_and_a_caller_that_leaves() -> None:
    async def main() -> None:
        p, sent = pooler()
        task = asyncio.create_task(p.run([[1], [2]]))
        await asyncio.sleep(0)
        assert p.on_rejected(RequestRejected(101, "queue full"))
        assert not p.on_rejected(RequestRejected(7, "someone else's"))
        with pytest.raises(PoolingRejected, match="queue full"):
            await task
        # The rejected one never entered the queue: only the other is aborted.
        assert [m.request_id for m in sent if isinstance(m, AbortRequest)] == [100]
        sent.clear()
        task = asyncio.create_task(p.run([[1], [2]]))
        await asyncio.sleep(0)
        p.on_output(PoolOutput(np.array([102], np.int64), np.ones((1, 2), np.float32)))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [m.request_id for m in sent if isinstance(m, AbortRequest)] == [103]
        assert p.num_in_flight == 0

    asyncio.run(main())
