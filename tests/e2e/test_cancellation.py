"""Cancelled, disconnected and timed-out requests are aborted through the whole pipeline: their
KV blocks come back (read over the `tandem.admin.Admin` service) and the server keeps serving."""
from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import grpc
import pytest

from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.rpc.client import GenerateOptions, TandemClient
from tests.e2e.server import Server, running

pytestmark = pytest.mark.slow

LONG = GenerateOptions(max_new_tokens=1000, min_new_tokens=1000)


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(tiny_model_dir))


def idle(total: int) -> object:
    return lambda s: (s.num_free_blocks, s.num_running, s.num_waiting) == (total, 0, 0)


@pytest.fixture(scope="module")
def total_blocks(server: Server) -> int:
    stats = server.wait_stats(lambda s: s.num_total_blocks > 0)
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing runs yet
    return int(stats.num_total_blocks)


def test_cancelled_and_disconnected_streams_give_their_blocks_back(server: Server,
                                                                   total_blocks: int) -> None:
    calls: list[tuple[grpc.Future, TandemClient | None]] = []
    for i in range(8):
        # Half cancel their call; the other half close their own channel (a vanished client).
        own = TandemClient(f"127.0.0.1:{server.port}") if i % 2 else None
        call = (own or server.client).stream(f"Story number {i}: once upon a time", LONG)
        it = iter(call)
        next(it)  # the head
        next(it)  # a first token: the request is running
        calls.append((call, own))
    running = server.wait_stats(lambda s: s.num_running == 8)
    assert running.num_free_blocks < total_blocks
    before = running.tokens_delivered
    t0 = time.monotonic()
    for call, own in calls:
        if own is None:
            call.cancel()
        else:
            own.close()
    server.wait_stats(idle(total_blocks))
    took = time.monotonic() - t0
    for call, own in calls:
        if own is None:
            assert call.code() == grpc.StatusCode.CANCELLED
    # Far fewer tokens than the 8 x 1000 asked for: generation stopped.
    after = server.client.stats().tokens_delivered
    assert after - before < 8 * 500, (before, after)
    assert took < 10
    # The server keeps serving, with the same greedy text as before.
    text = "Story number 0: once upon a time"
    opts = GenerateOptions(max_new_tokens=8)
    a = server.client.generate([text], opts)[0]
    b = "".join(m.text for m in server.client.stream(text, opts))
    assert a.text == b and a.generated_token_count == 8


def test_cancelled_batch_and_expired_deadline_give_their_blocks_back(
        server: Server, total_blocks: int) -> None:
    req = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=f"Batch prompt {i}") for i in range(3)],
        params=LONG.to_proto())
    future = server.client.stub.Generate.future(req)
    server.wait_stats(lambda s: s.num_running == 3)
    future.cancel()
    server.wait_stats(idle(total_blocks))
    # A client deadline that passes is a disconnect too.
    with pytest.raises(grpc.RpcError) as err:
        list(server.client.stream("Deadline prompt", LONG, timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_stats(idle(total_blocks))


def test_time_limit_ends_with_the_text_so_far(server: Server, total_blocks: int) -> None:
    texts = ["Time limited one", "Time limited two"]
    ref = server.client.generate(texts, GenerateOptions(max_new_tokens=10, min_new_tokens=10))
    t0 = time.monotonic()
    out = server.client.generate(texts, GenerateOptions(max_new_tokens=1000, min_new_tokens=1000,
                                                        time_limit_millis=1500))
    assert time.monotonic() - t0 < 10
    for r, full in zip(out, ref, strict=True):
        assert r.stop_reason == pb.TIME_LIMIT
        assert 0 < r.generated_token_count < 1000
        # Greedy: the same text as without the limit, cut short.
        assert r.text.startswith(full.text) or full.text.startswith(r.text)
    msgs = list(server.client.stream(texts[0], GenerateOptions(
        max_new_tokens=1000, min_new_tokens=1000, time_limit_millis=500)))
    assert msgs[-1].stop_reason == pb.TIME_LIMIT
    assert msgs[-1].generated_token_count < 1000
    so_far = "".join(m.text for m in msgs[1:])
    assert so_far.startswith(ref[0].text) or ref[0].text.startswith(so_far)
    server.wait_stats(idle(total_blocks))
