"""The frontend's per-stream output buffer: folding behind a slow client, and its bound."""
from __future__ import annotations

import asyncio

from tandem_serve.frontend.stream_buffer import FOLD_AFTER, StreamBuffer, payload_bytes
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta


def delta(i: int, detail: bool = False) -> OutputDelta:
    d = OutputDelta(7, f"t{i} ", i + 1, token_ids=[i])
    if detail:
        d.token_texts, d.logprobs, d.ranks = [f"t{i}"], [-0.5], [1]
        d.top_texts, d.top_logprobs, d.top_ids = [["a", "bb"]], [[-0.1, -0.2]], [[1, 2]]
    return d


def drain(buf: StreamBuffer) -> list[object]:
    out = []
    while not buf.queue.empty():
        item = buf.queue.get_nowait()
        buf.took(item)
        out.append(item)
    return out


def test_a_client_that_keeps_up_costs_no_folding_and_no_accounting() -> None:
    buf = StreamBuffer(limit=100)
    for i in range(1000):
        assert buf.put(delta(i, detail=True))
        drain(buf)
    assert buf.buffered == 0 and not buf.overflowed


def test_behind_a_slow_client_deltas_fold_and_nothing_is_lost() -> None:
    buf = StreamBuffer(limit=0)  # no limit
    parts = [delta(i, detail=True) for i in range(100)]
    want_text = "".join(p.text for p in parts)
    folded = sum(payload_bytes(p) for p in parts[FOLD_AFTER:])
    for p in parts:
        assert buf.put(p)
    assert buf.queue.qsize() == FOLD_AFTER
    assert buf.buffered == folded  # additive: the folded delta costs the sum of its parts
    got = drain(buf)
    assert buf.buffered == 0
    assert "".join(d.text for d in got) == want_text  # type: ignore[attr-defined]
    assert [t for d in got for t in d.token_ids] == list(range(100))  # type: ignore[attr-defined]
    assert got[-1].num_generated == 100  # type: ignore[attr-defined]


def test_past_the_limit_the_stream_overflows_drops_what_it_held_and_ignores_the_rest() -> None:
    buf = StreamBuffer(limit=2000)
    ok = [buf.put(delta(i, detail=True)) for i in range(FOLD_AFTER + 200)]
    assert False in ok
    first = ok.index(False)
    assert all(ok[:first]) and all(ok[first + 1:])  # later puts are accepted and dropped
    assert buf.overflowed and buf.queue.empty()
    assert buf.buffered > 2000
    assert buf.put(delta(999)) and buf.queue.empty()


def test_prompt_detail_and_finished_deltas_are_never_folded_into() -> None:
    buf = StreamBuffer(limit=0)
    for i in range(FOLD_AFTER - 1):
        buf.put(delta(i))
    end = delta(99)
    end.finish_reason = FinishReason.MAX_TOKENS
    buf.put(end)
    buf.put(delta(100))  # behind a finished delta: queued, not folded into it
    assert buf.queue.qsize() == FOLD_AFTER + 1
    first = delta(0)
    first.prompt_logprobs = [0.0]
    buf.put(first)  # carries prompt detail: never merged into another
    assert buf.queue.qsize() == FOLD_AFTER + 2


def test_errors_queue_behind_deltas() -> None:
    async def run() -> list[object]:
        buf = StreamBuffer(limit=0)
        buf.put(delta(0))
        buf.put(RuntimeError("boom"))
        return [await buf.queue.get(), await buf.queue.get()]

    first, second = asyncio.run(run())
    assert isinstance(first, OutputDelta) and isinstance(second, RuntimeError)
