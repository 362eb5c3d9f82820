"""Request spans (frontend/request_traces.py) into an in-memory exporter: vLLM's attribute
names, the caller's parent, the scheduler's late queue time, errors and abandoned streams."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem_serve.frontend import request_traces as rt
from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import OutputDelta

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def traces() -> tuple[rt.RequestTraces, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    return rt.RequestTraces("", "tiny", processor), exporter


async def engine(n: int, fail_after: int = -1, closed: list[bool] | None = None
                 ) -> AsyncIterator[OutputDelta]:
    try:
        for i in range(1, n + 1):
            if i == fail_after:
                raise EngineError("UNAVAILABLE", "gpu worker died")
            await asyncio.sleep(0.001)
            done = FinishReason.MAX_TOKENS if i == n else FinishReason.NOT_FINISHED
            yield OutputDelta(7, f"w{i}", i, [i], finish_reason=done)
    finally:
        if closed is not None:
            closed.append(True)


def facts(carrier: dict[str, str] | None = None) -> rt.RequestFacts:
    token = rt.CALLER_TRACE.set(carrier)
    try:
        sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4)
        return rt.request_facts(7, arrived=0.0, prompt_tokens=11, sampling=sampling, n=2)
    finally:
        rt.CALLER_TRACE.reset(token)


async def drain(it: AsyncIterator[OutputDelta]) -> int:
    return len([d async for d in it])


def test_a_span_carries_vllms_attributes_and_the_callers_parent() -> None:
    t, exporter = traces()
    f = facts({"traceparent": f"00-{TRACE}-{PARENT}-01"})
    f.arrived = time.monotonic()
    assert asyncio.run(drain(t.traced(engine(4), f))) == 4
    assert exporter.get_finished_spans() == ()  # it waits for its time in queue
    t.on_queue_times([99, 7], [0.5, 0.25])
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT
    a = span.attributes
    assert a is not None
    assert a["gen_ai.request.id"] == "7" and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == 11 and a["gen_ai.usage.completion_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.request.top_k"] == 5 and a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.n"] == 2 and a["gen_ai.latency.time_in_queue"] == 0.25
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert span.end_time - span.start_time == pytest.approx(a["gen_ai.latency.e2e"] * 1e9,
                                                            rel=1e-3)
    t.close()


def test_without_a_queue_time_it_is_sent_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt, "QUEUE_WAIT", 0.0)
    t, exporter = traces()
    asyncio.run(drain(t.traced(engine(2), facts())))
    (span,) = exporter.get_finished_spans()  # sent at once: the wait is over
    assert span.parent is None and "gen_ai.latency.time_in_queue" not in span.attributes


def test_an_engine_error_marks_the_span() -> None:
    t, exporter = traces()
    with pytest.raises(EngineError):
        asyncio.run(drain(t.traced(engine(5, fail_after=3), facts())))
    t.close()  # sends what still waited for a queue time
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert "gpu worker died" in (span.status.description or "")
    assert span.attributes["gen_ai.usage.completion_tokens"] == 2


def test_a_caller_that_leaves_closes_the_engine_stream_at_once() -> None:
    t, exporter = traces()
    closed: list[bool] = []

    async def leave() -> None:
        it = t.traced(engine(10, closed=closed), facts())
        await it.__anext__()
        await it.aclose()  # type: ignore[attr-defined]
        assert closed == [True]  # the engine's generator ran its finally: the abort

    asyncio.run(leave())
    t.close()
    (span,) = exporter.get_finished_spans()
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("abort",)


def test_a_collector_that_never_answers_does_not_slow_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The OTLP exporter to a port that takes connections and never answers: the requests
    run at their own pace, and the last flush stops at the export timeout."""
    monkeypatch.setattr(rt, "EXPORT_TIMEOUT", 0.5)
    monkeypatch.setattr(rt, "QUEUE_WAIT", 0.0)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")  # export at once: into the wall
    with socket.socket() as deaf:
        deaf.bind(("127.0.0.1", 0))
        deaf.listen(64)
        t = rt.RequestTraces(f"http://127.0.0.1:{deaf.getsockname()[1]}/v1/traces", "tiny")

        async def many() -> float:
            start = time.monotonic()
            for _ in range(200):
                await drain(t.traced(engine(1), facts()))
            return time.monotonic() - start

        took = asyncio.run(many())
        closing = time.monotonic()
        t.close()
        closed_in = time.monotonic() - closing
    # 200 one-token requests at 1 ms each (engine's sleep) plus their spans.
    assert took < 2.0, took
    assert closed_in < 3.0, closed_in
