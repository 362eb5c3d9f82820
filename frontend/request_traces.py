"""`--otlp-traces-endpoint`: one OpenTelemetry span per engine request, as vLLM exports them.

The span ("llm_request", kind SERVER) runs from the request's arrival to its last delta and
carries vLLM's `gen_ai.*` attribute names (vllm/tracing.py's SpanAttributes), so a trace view
or a query written for vLLM reads Tandem's spans unchanged: the request id, prompt and
completion tokens, time to first token, end to end, time in queue, the sampling parameters,
the model and the finish reason.  Its parent is the caller's W3C `traceparent` (HTTP header
or gRPC metadata), which the APIs put in `CALLER_TRACE` for the request's task.

Serving never waits for the collector: spans are built when a request ends and handed to
the SDK's BatchSpanProcessor, which exports them in batches from a thread of its own and
drops them (bounded queue) when the collector is slow or gone.

Time in queue is the scheduler's (arrival to first scheduling), which reaches the frontend
in its next `EngineStats` report (every 0.2 s) with the request's id.  A request that ends
before that report waits for it, up to QUEUE_WAIT, before its span is sent; a request
that was never scheduled (refused) has no time in queue.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from tandem_serve.frontend.vllm_metrics import FINISH_REASON
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.token_messages import OutputDelta

# The caller's W3C trace context headers (traceparent, tracestate) for the current request.
CALLER_TRACE: ContextVar[Mapping[str, str] | None] = ContextVar("caller_trace", default=None)
TRACE_HEADERS = ("traceparent", "tracestate")
QUEUE_WAIT = 1.0  # seconds a finished request's span waits for its time in queue
# Seconds one export may take, retries included (the SDK's default is 10): it also bounds the
# last flush at shutdown, which must fit in the pod's termination grace.
EXPORT_TIMEOUT = 5.0
SPAN_NAME = "llm_request"  # vLLM's


@dataclass
class RequestFacts:
    """What one request's span says, gathered while it runs (times: time.monotonic())."""

    request_id: int
    arrived: float
    prompt_tokens: int
    attributes: dict[str, AttributeValue]
    carrier: Mapping[str, str] | None
    first_token_at: float | None = None
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    ended_at: float = 0.0
    queue_time: float | None = None
    sent_by: float = field(default=0.0)  # the latest moment to send it without queue time


def request_facts(request_id: int, arrived: float, prompt_tokens: int,
                  sampling: SamplingParams, n: int, correlation_id: str = "") -> RequestFacts:
    """A request's facts as it is submitted, with the caller's trace context.
    `correlation_id`: what the server's log lines about the request are tagged with."""
    attributes: dict[str, AttributeValue] = {
        "tandem.correlation_id": correlation_id,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.top_k": sampling.top_k,
        "gen_ai.request.max_tokens": sampling.max_new_tokens,
        "gen_ai.request.n": n,
    }
    return RequestFacts(request_id, arrived, prompt_tokens, attributes, CALLER_TRACE.get())


def caller_headers(pairs: Mapping[str, str]) -> Mapping[str, str] | None:
    """The trace context headers among a request's headers or metadata (lower-case keys)."""
    found = {h: pairs[h] for h in TRACE_HEADERS if h in pairs}
    return found or None


def _wall_ns(monotonic: float) -> int:
    """A time.monotonic() instant on the wall clock, which OTLP timestamps are."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class RequestTraces:
    """The span of every request; `close()` flushes what is still queued."""

    def __init__(self, endpoint: str, model_name: str,
                 processor: SpanProcessor | None = None) -> None:
        """`processor`: where spans go (default: batches to `endpoint` over OTLP/HTTP)."""
        self._provider = TracerProvider(resource=Resource.create({"service.name": "tandem"}))
        self._provider.add_span_processor(
            processor or BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                             timeout=EXPORT_TIMEOUT)))
        self._tracer = self._provider.get_tracer("tandem_serve")
        self._propagator = TraceContextTextMapPropagator()
        self._model = model_name
        self._open: dict[int, RequestFacts] = {}  # running, or ended and waiting for queue time

    async def traced(self, deltas: AsyncIterator[OutputDelta], facts: RequestFacts
                     ) -> AsyncIterator[OutputDelta]:
        """`deltas`, passed through, noting what the span will say."""
        self._open[facts.request_id] = facts
        try:
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                async for d in deltas:
                    self._note(facts, d)
                    yield d
        except Exception as exc:  # noqa: BLE001 - noted, then raised unchanged
            facts.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if not facts.finish_reason and not facts.error:
                facts.finish_reason = "abort"  # the caller went away
            facts.ended_at = time.monotonic()
            facts.sent_by = facts.ended_at + QUEUE_WAIT
            self._maybe_send(facts, facts.ended_at)

    @staticmethod
    def _note(facts: RequestFacts, d: OutputDelta) -> None:
        if d.num_generated > 0 and facts.first_token_at is None:
            facts.first_token_at = time.monotonic()
        facts.completion_tokens = max(facts.completion_tokens, d.num_generated)
        if d.finish_reason != FinishReason.NOT_FINISHED:
            facts.finish_reason = FINISH_REASON[d.finish_reason]

    def on_queue_times(self, request_ids: list[int], seconds: list[float]) -> None:
        """The scheduler's report: queue times of requests first scheduled since the last
        one; also sends the ended spans that waited long enough."""
        for rid, q in zip(request_ids, seconds, strict=False):
            facts = self._open.get(rid)
            if facts is not None:
                facts.queue_time = q
        now = time.monotonic()
        for facts in [f for f in self._open.values() if f.ended_at]:
            self._maybe_send(facts, now)

    def _maybe_send(self, facts: RequestFacts, now: float) -> None:
        if facts.queue_time is None and now < facts.sent_by:
            return
        del self._open[facts.request_id]
        self._send(facts)

    def _send(self, f: RequestFacts) -> None:
        attrs: dict[str, AttributeValue] = dict(f.attributes)
        attrs.update({
            "gen_ai.request.id": str(f.request_id),
            "gen_ai.response.model": self._model,
            "gen_ai.usage.prompt_tokens": f.prompt_tokens,
            "gen_ai.usage.completion_tokens": f.completion_tokens,
            "gen_ai.latency.e2e": f.ended_at - f.arrived,
        })
        if f.first_token_at is not None:
            attrs["gen_ai.latency.time_to_first_token"] = f.first_token_at - f.arrived
        if f.queue_time is not None:
            attrs["gen_ai.latency.time_in_queue"] = f.queue_time
        if f.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [f.finish_reason]
        parent = self._propagator.extract(f.carrier) if f.carrier else None
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                       attributes=attrs, start_time=_wall_ns(f.arrived))
        if f.error:
            span.set_status(Status(StatusCode.ERROR, f.error))
        span.end(end_time=_wall_ns(f.ended_at))

    def close(self) -> None:
        """Send what is still waiting, flush the exporter's queue (bounded by its timeout)."""
        for facts in list(self._open.values()):
            if facts.ended_at:
                del self._open[facts.request_id]
                self._send(facts)
        self._provider.shutdown()
