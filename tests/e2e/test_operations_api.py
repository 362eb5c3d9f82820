"""One real server with an API key (from TANDEM_API_KEY), request traces to a local OTLP/HTTP
receiver and a short liveness timeout: 401 / UNAUTHENTICATED without the key, a span with
the caller's trace id and exact token counts, /live 503 while the gpu worker is stopped
(SIGSTOP) with a request in flight and 200 after SIGCONT, and 200 while draining."""
from __future__ import annotations

import os
import pathlib
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tandem_serve.rpc.client import GenerateOptions, TandemClient
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

KEY = "test-key-8d1f"
LIVENESS_TIMEOUT = 3.0
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span it was sent, as (span, its attributes)."""

    def __init__(self) -> None:
        self.spans: list[tuple[Any, dict[str, Any]]] = []
        super().__init__(("127.0.0.1", 0), _Receive)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def span(self, trace_id: str, timeout: float = 20.0) -> tuple[Any, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for span, attrs in list(self.spans):
                if span.trace_id.hex() == trace_id:
                    return span, attrs
            time.sleep(0.05)
        raise AssertionError(f"no span of trace {trace_id}: {len(self.spans)} spans came")


class _Receive(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {a.key: _value(a.value) for a in span.attributes}
                    self.server.spans.append((span, attrs))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path, collector: Collector) -> Iterator[Server]:
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    s = Server(str(tiny_model_dir), "--otlp-traces-endpoint", endpoint, "--liveness-timeout",
               str(LIVENESS_TIMEOUT), "--max-num-seqs", "1", http=True,
               env={"TANDEM_API_KEY": KEY, "OTEL_BSP_SCHEDULE_DELAY": "100"}).wait_ready()
    try:
        yield s
    finally:
        assert s.stop() == 0  # the drain test stopped it already: its exit status
        assert not s.leftovers()


def keyed(server: Server, key: str = KEY) -> TandemClient:
    return TandemClient(f"127.0.0.1:{server.port}", api_key=key)


def http(server: Server, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{server.http_port}{path}", timeout=10)


def test_http_needs_the_key(server: Server) -> None:
    base = f"http://127.0.0.1:{server.http_port}/v1"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    assert good.models.list().data
    for path in ("/health", "/live", "/metrics"):
        assert http(server, path).status_code == 200, path


def test_only_the_frontend_holds_the_key(server: Server) -> None:
    """The children's config file (and their command lines) do not carry it."""
    tmp = tempfile.gettempdir()
    (run_dir,) = [n for n in os.listdir(tmp) if n.startswith(f"tandem-{server.proc.pid}-")]
    config = pathlib.Path(tmp, run_dir, "config.json").read_text()
    assert '"api_key": ""' in config and KEY not in config
    for pid in server.role_pids().values():
        assert KEY not in pathlib.Path(f"/proc/{pid}/cmdline").read_text()


def test_grpc_needs_the_key_but_for_health(server: Server) -> None:
    for key in ("", "wrong"):
        client = keyed(server, key)
        with pytest.raises(grpc.RpcError) as e:
            client.generate(["Hello"], GenerateOptions(max_new_tokens=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            client.stats()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert client.is_serving()
        client.close()
    client = keyed(server)
    assert client.generate(["Hello"], GenerateOptions(max_new_tokens=2))[0].generated_token_count
    client.close()


def test_a_request_span_reaches_the_collector(server: Server, collector: Collector) -> None:
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=KEY,
                        max_retries=0)
    out = api.completions.create(model=api.models.list().data[0].id, prompt="Once upon a time",
                                 max_tokens=7, temperature=0.5, top_p=0.9, seed=3,
                                 extra_headers={"traceparent": traceparent,
                                                "x-request-id": "trace-me-1"})
    assert out.usage is not None
    span, attrs = collector.span(TRACE_ID)
    assert span.name == "llm_request" and span.parent_span_id.hex() == PARENT_ID
    assert attrs["gen_ai.usage.prompt_tokens"] == out.usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == out.usage.completion_tokens
    assert attrs["gen_ai.request.max_tokens"] == 7 and attrs["gen_ai.request.n"] == 1
    assert attrs["tandem.correlation_id"] == "trace-me-1"  # the server log's tag
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.request.top_p"] == 0.9
    e2e, ttft = attrs["gen_ai.latency.e2e"], attrs["gen_ai.latency.time_to_first_token"]
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= ttft <= e2e
    assert attrs["gen_ai.response.finish_reasons"] == [out.choices[0].finish_reason]
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9,
                                                                                rel=0.01)
    # gRPC: the trace context in metadata.
    grpc_trace = "0af7651916cd43dd8448eb211c80319c"
    client = keyed(server)
    resp = client.generate(["Hello there"], GenerateOptions(max_new_tokens=5),
                           metadata=[("traceparent", f"00-{grpc_trace}-b7ad6b7169203331-01")])
    client.close()
    _, attrs = collector.span(grpc_trace)
    assert attrs["gen_ai.usage.completion_tokens"] == resp[0].generated_token_count
    assert attrs["gen_ai.usage.prompt_tokens"] == resp[0].input_token_count


class LongStream:
    """A GenerateStream of `tokens` tokens on a thread of its own."""

    def __init__(self, server: Server, tokens: int) -> None:
        self.client = keyed(server)
        self.first = threading.Event()
        self.count = 0
        self.error: grpc.RpcError | None = None
        opts = GenerateOptions(max_new_tokens=tokens, min_new_tokens=tokens)
        self.call = self.client.stream("Once upon a time", opts)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for resp in self.call:
                self.count = resp.generated_token_count or self.count
                self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
        self.first.set()

    def end(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.client.close()


def wait_status(server: Server, status: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if http(server, "/live").status_code == status:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"/live never answered {status} within {timeout} s")


def test_live_sees_a_stopped_gpu_worker(server: Server) -> None:
    worker = server.role_pids()["gpu-worker"]
    stream = LongStream(server, 1000)
    try:
        assert stream.first.wait(30) and stream.error is None
        os.kill(worker, signal.SIGSTOP)
        try:
            took = wait_status(server, 503, LIVENESS_TIMEOUT + 5)
            assert took >= LIVENESS_TIMEOUT - 1.0, took  # not before the timeout
            body = http(server, "/live").json()["error"]
            assert body["code"] == "engine_stalled" and "--liveness-timeout" in body["message"]
            assert http(server, "/health").status_code == 200  # readiness is another question
        finally:
            os.kill(worker, signal.SIGCONT)
        wait_status(server, 200, 5)
    finally:
        stream.end()


def test_live_stays_200_while_draining(server: Server) -> None:
    """Last: it ends the server. --max-num-seqs 1 queues the streams, so the drain lasts."""
    streams = [LongStream(server, 1000) for _ in range(4)]
    assert streams[0].first.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    seen = []
    deadline = time.monotonic() + LIVENESS_TIMEOUT + 1.0  # past the timeout, still live
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            health, live = http(server, "/health"), http(server, "/live")
        except httpx.TransportError:
            break  # the drain ended and the server closed its port
        seen.append((health.status_code, live.status_code))
        time.sleep(0.1)
    assert seen and all(live == 200 for _, live in seen), seen
    assert any(health == 503 for health, _ in seen), seen
    for s in streams:
        s.end()
    assert server.proc.wait(60) == 0
    log = server.log()
    assert log.count("not live: no engine plan has completed") == 1, log  # the SIGSTOP's
