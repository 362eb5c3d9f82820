"""Serving-benchmark metrics on hand-computed traces, the printed block, the JSON, the runner.

No server: the runner is driven with a fake backend, the HTTP/SSE reader with bytes.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time

import pytest

from tandem_serve.bench.serve.backends.base import Backend, BackendOptions
from tandem_serve.bench.serve.backends.http_sse import read_http_response, sse_events
from tandem_serve.bench.serve.backends.openai_compatible import TransformersServeBackend
from tandem_serve.bench.serve.backends.tandem import TandemBackend
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.main import add_arguments, config_from_args
from tandem_serve.bench.serve.metrics import (
    RequestRecord,
    calculate_metrics,
    format_result,
    peak_output_rate,
)
from tandem_serve.bench.serve.run import run_benchmark

VLLM_KEYS = {
    "duration", "completed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "errors",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}


def _rec(send: float, chunks: list[tuple[float, int]], input_tokens: int,
         success: bool = True, error: str = "") -> RequestRecord:
    r = RequestRecord(send_time=send, success=success, input_tokens=input_tokens, error=error)
    for t, n in chunks:
        r.add_chunk(t, n)
    r.output_tokens = sum(n for _, n in chunks)
    r.end_time = chunks[-1][0] if chunks else send
    return r


def trace() -> list[RequestRecord]:
    """Three successes (one with multi-token chunks, one single-token) and one failure.

    A: ttft 100, e2el 250, 4 tokens -> tpot 150/3 = 50, itl [50, 100]
    B: ttft 200, e2el 300, 8 tokens in two chunks of 4 -> tpot 100/7, itl [100]
    C: ttft 300, e2el 300, 1 token -> no tpot, no itl
    D: failed after one token: counted as failed, in no statistic
    """
    return [
        _rec(0.000, [(0.100, 1), (0.150, 2), (0.250, 1)], 10),
        _rec(0.050, [(0.250, 4), (0.350, 4)], 20),
        _rec(0.100, [(0.400, 1)], 5),
        _rec(0.200, [(0.300, 1)], 7, success=False, error="UNAVAILABLE: worker died"),
    ]


def test_record_properties() -> None:
    a, b, c, _ = trace()
    assert a.ttft == pytest.approx(0.100)
    assert a.latency == pytest.approx(0.250)
    assert a.itl == pytest.approx([0.050, 0.100])
    assert a.tpot == pytest.approx(0.050)
    assert b.tpot == pytest.approx(0.100 / 7)
    assert c.tpot is None and c.itl == []
    empty = RequestRecord(send_time=1.0, success=True, end_time=1.5)
    assert empty.ttft == 0.0 and empty.latency == pytest.approx(0.5) and empty.tpot is None


def test_metrics_on_hand_computed_trace() -> None:
    m = calculate_metrics(trace(), duration_s=0.5)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35  # the failed request's 7 are not counted
    assert m["total_output_tokens"] == 13
    assert m["duration"] == 0.5
    assert m["request_throughput"] == pytest.approx(6.0)
    assert m["input_throughput"] == pytest.approx(70.0)
    assert m["output_throughput"] == pytest.approx(26.0)
    assert m["total_token_throughput"] == pytest.approx(96.0)

    ap = pytest.approx
    # TTFT [100, 200, 300]; numpy's linear percentile: p99 = 200 + 0.98 * 100.
    assert m["mean_ttft_ms"] == ap(200.0)
    assert m["median_ttft_ms"] == ap(200.0) and m["p50_ttft_ms"] == ap(200.0)
    assert m["std_ttft_ms"] == ap(math.sqrt(20000 / 3))
    assert m["p99_ttft_ms"] == ap(298.0)
    assert m["p90_ttft_ms"] == ap(280.0)
    # TPOT [50, 100/7]: the first token is excluded, the 1-token request has none.
    tp = [50.0, 100 / 7]
    assert m["mean_tpot_ms"] == ap(sum(tp) / 2)
    assert m["median_tpot_ms"] == ap(sum(tp) / 2)
    assert m["p99_tpot_ms"] == ap(tp[1] + 0.99 * (tp[0] - tp[1]))
    # ITL from chunk gaps, whatever each chunk holds: [50, 100, 100].
    assert m["mean_itl_ms"] == ap(250 / 3)
    assert m["median_itl_ms"] == ap(100.0)
    assert m["p99_itl_ms"] == ap(100.0)
    assert m["p90_itl_ms"] == ap(100.0)
    # E2EL [250, 300, 300].
    assert m["mean_e2el_ms"] == ap(850 / 3)
    assert m["median_e2el_ms"] == ap(300.0)
    assert m["p99_e2el_ms"] == ap(300.0)
    # ITL above TPOT is the multi-step signature the reference explains.
    assert m["mean_itl_ms"] > m["mean_tpot_ms"]


def test_failed_requests_are_listed_but_not_measured() -> None:
    m = calculate_metrics(trace(), duration_s=0.5)
    assert m["input_lens"] == [10, 20, 5, 7]
    assert m["output_lens"] == [4, 8, 1, 0]
    assert m["ttfts"] == pytest.approx([0.1, 0.2, 0.3, 0.0])
    assert m["itls"][1] == pytest.approx([0.1]) and m["itls"][3] == []
    assert m["errors"] == ["", "", "", "UNAVAILABLE: worker died"]
    # A failure with a huge latency would move the mean; it must not.
    slow_fail = _rec(0.0, [(9.0, 1)], 3, success=False, error="DEADLINE_EXCEEDED")
    m2 = calculate_metrics(trace()[:3] + [slow_fail], duration_s=0.5)
    assert m2["mean_ttft_ms"] == pytest.approx(200.0)
    assert m2["mean_e2el_ms"] == pytest.approx(850 / 3)


def test_all_failed_gives_zeros_not_errors() -> None:
    m = calculate_metrics([_rec(0.0, [], 3, success=False, error="x")], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    assert "Successful requests:" in format_result(m)


def test_peak_output_rate_counts_tokens_per_chunk() -> None:
    # Bucket 0 s: A's 4 tokens + B's 8 tokens + C's 1 = 13; all three active in it.
    assert peak_output_rate(trace()) == (13.0, 3)
    late = _rec(0.0, [(0.5, 2), (1.2, 5), (1.4, 1)], 1)
    assert peak_output_rate([late]) == (6.0, 1)


def test_json_has_vllm_keys_and_is_valid_json() -> None:
    m = calculate_metrics(trace(), duration_s=0.5)
    assert VLLM_KEYS <= set(m)
    assert json.loads(json.dumps(m, allow_nan=False))["completed"] == 3


# ---------------------------------------------------------------------- printed block

TITLE = "============ Serving Benchmark Result ============"
RULES = [
    "---------------Time to First Token----------------",
    "-----Time per Output Token (excl. 1st token)------",
    "---------------Inter-token Latency----------------",
    "----------------End-to-end Latency----------------",
]
LABELS = [
    "Successful requests:", "Failed requests:", "Benchmark duration (s):",
    "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
    "Input token throughput (tok/s):", "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):",
    "Mean E2EL (ms):", "Median E2EL (ms):", "P99 E2EL (ms):",
]


def test_printed_block_layout() -> None:
    m = calculate_metrics(trace(), duration_s=0.5)
    lines = format_result(m).splitlines()
    assert lines[0] == TITLE and len(TITLE) == 50
    assert lines[-1] == "=" * 50
    assert [ln for ln in lines if ln.startswith("-")] == RULES
    assert all(len(r) == 50 for r in RULES)
    body = [ln for ln in lines[1:-1] if not ln.startswith("-")]
    assert [ln[:40].rstrip() for ln in body] == LABELS
    # vLLM's "{:<40} {:<10}" / "{:<40} {:<10.2f}" padding, character for character.
    assert lines[1] == f"{'Successful requests:':<40} {3:<10}"
    assert "Benchmark duration (s):".ljust(40) + " " + "0.50".ljust(10) in lines
    assert "Mean TTFT (ms):".ljust(40) + " " + "200.00".ljust(10) in lines
    assert "P99 TTFT (ms):".ljust(40) + " " + "298.00".ljust(10) in lines
    # The section order is TTFT, TPOT, ITL, E2EL, each rule right above its lines.
    for rule, name in zip(RULES, ("TTFT", "TPOT", "ITL", "E2EL"), strict=True):
        i = lines.index(rule)
        assert lines[i + 1].startswith(f"Mean {name} (ms):")


def test_block_optional_lines() -> None:
    m = calculate_metrics(trace(), duration_s=0.5)
    plain = format_result(m)
    assert "Maximum request concurrency:" not in plain
    assert "Request rate configured (RPS):" not in plain
    lines = format_result(m, max_concurrency=8, request_rate=10.0).splitlines()
    assert lines[3] == f"{'Maximum request concurrency:':<40} {8:<10}"
    assert lines[4] == f"{'Request rate configured (RPS):':<40} {10.0:<10.2f}"
    assert lines[5].startswith("Benchmark duration (s):")
    # Several percentiles print in the order asked, p50 as "P50".
    more = format_result(m, percentiles=(50, 99)).splitlines()
    i = more.index(RULES[0])
    assert [ln[:40].rstrip() for ln in more[i + 1:i + 5]] == [
        "Mean TTFT (ms):", "Median TTFT (ms):", "P50 TTFT (ms):", "P99 TTFT (ms):"]


# ------------------------------------------------------------------ runner, fake backend


class FakeBackend(Backend):
    """Streams `output_len` tokens in chunks of 2, 2 ms apart, and tracks concurrency."""

    name = "fake"

    def __init__(self, fail_every: int = 0) -> None:
        super().__init__(BackendOptions())
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls: list[int] = []
        self.fail_every = fail_every
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def run_one(self, item: BenchItem) -> RequestRecord:
        self.calls.append(item.index)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        try:
            await asyncio.sleep(0.004)
            if self.fail_every and item.index % self.fail_every == self.fail_every - 1:
                rec.error = "RESOURCE_EXHAUSTED: queue full"
                return rec
            done = 0
            while done < item.output_len:
                await asyncio.sleep(0.002)
                n = min(2, item.output_len - done)
                done += n
                rec.add_chunk(time.perf_counter(), n)
                self.progress.add_tokens(n)
            rec.output_tokens = done
            rec.success = True
            return rec
        finally:
            self.in_flight -= 1


def _items(n: int, out: int = 6) -> list[BenchItem]:
    return [BenchItem(i, f"prompt {i}", 10 + i, out) for i in range(n)]


def test_run_benchmark_with_fake_backend() -> None:
    backend = FakeBackend(fail_every=5)
    config = BenchConfig(backend="fake", max_concurrency=3, warmup=2, num_prompts=10)
    result = asyncio.run(run_benchmark(config, items=_items(10), backend=backend))
    assert backend.started and backend.closed
    assert backend.max_in_flight == 3  # the cap held, and was reached
    assert len(backend.calls) == 12  # two warm-up requests went first...
    assert result["completed"] == 8 and result["failed"] == 2  # ...and were not counted
    assert result["num_prompts"] == 10 and result["max_concurrency"] == 3
    assert result["total_output_tokens"] == 8 * 6
    assert result["errors"][4] == "RESOURCE_EXHAUSTED: queue full"
    assert result["output_lens"][4] == 0
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0
    assert backend.progress.done == 10 and backend.progress.failed == 2
    assert "Maximum request concurrency:" in format_result(result)
    json.dumps(result, allow_nan=False)


def test_run_benchmark_paces_poisson_arrivals() -> None:
    backend = FakeBackend()
    config = BenchConfig(backend="fake", request_rate=200.0, seed=1)
    result = asyncio.run(run_benchmark(config, items=_items(20, out=2), backend=backend))
    # 19 exponential gaps of mean 5 ms: the run cannot be over before most of them passed.
    assert result["duration"] > 0.03
    assert result["request_rate"] == 200.0
    assert "Request rate configured (RPS):" in format_result(result)


def test_run_benchmark_progress_line() -> None:
    import io

    stream = io.StringIO()
    config = BenchConfig(backend="fake", progress_interval=0.005)
    asyncio.run(run_benchmark(config, items=_items(6), backend=FakeBackend(), log_stream=stream))
    text = stream.getvalue()
    assert "Traffic request rate: inf" in text
    assert "[bench] 6/6 requests, 36 tokens" in text.splitlines()[-1]


# ----------------------------------------------------------------------------- CLI


def test_cli_arguments() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    c = config_from_args(p.parse_args([
        "--backend", "transformers-serve", "--request-rate", "inf", "--stop", "\n\n",
        "--stop", "END", "--logprobs", "2", "--sample", "--max-concurrency", "4",
        "--dataset", "shared-prefix", "--prefix-len", "64", "--metric-percentiles", "50,99",
        "--output-json", "out.json", "--warmup", "3", "--model", "/m"]))
    assert c.backend == "transformers-serve" and math.isinf(c.request_rate)
    assert c.stop == ["\n\n", "END"] and c.logprobs == 2 and c.sample
    assert c.max_concurrency == 4 and c.prefix_len == 64 and c.warmup == 3
    assert c.metric_percentiles == (50.0, 99.0) and c.output_json == "out.json"
    assert c.backend_options().port == 8000 and c.backend_options().batch_size == 4
    d = config_from_args(p.parse_args(["--request-rate", "2.5", "--model", "/m"]))
    assert d.request_rate == 2.5 and d.backend_options().port == 8033 and d.progress
    with pytest.raises(SystemExit):
        p.parse_args(["--request-rate", "0"])


# ------------------------------------------------------------------ backend requests


def test_tandem_request_fixes_length_and_loads_postprocessing() -> None:
    opts = BackendOptions(logprobs=3, stop=["END"], sample=True, temperature=0.7, seed=100)
    req = TandemBackend(opts).request(BenchItem(5, "hello", 2, 17))
    st = req.params.stopping
    assert (st.max_new_tokens, st.min_new_tokens) == (17, 17)
    assert list(st.stop_sequences) == ["END"]
    r = req.params.response
    assert r.generated_tokens and r.token_logprobs and r.top_n_tokens == 3
    assert req.params.sampling.seed == 105
    assert req.params.sampling.temperature == pytest.approx(0.7)
    greedy = TandemBackend(BackendOptions()).request(BenchItem(0, "x", 1, 4))
    assert greedy.params.method == 0 and not greedy.params.response.generated_tokens


def test_adapters_spread_over_requests_and_only_tandem_names_them() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    c = config_from_args(p.parse_args(["--adapters", "a, b/c,", "--model", "/m"]))
    assert c.adapters == ["a", "b/c"]
    backend = TandemBackend(c.backend_options())
    ids = [backend.request(BenchItem(i, "x", 1, 4)).adapter_id for i in range(4)]
    assert ids == ["a", "b/c", "a", "b/c"]
    assert not TandemBackend(BackendOptions()).request(BenchItem(0, "x", 1, 4)).HasField(
        "adapter_id")
    hf = dataclasses.replace(c, backend="hf-generate")
    with pytest.raises(ValueError, match="--adapters: the hf-generate backend"):
        asyncio.run(run_benchmark(hf, items=[BenchItem(0, "x", 1, 4)]))


def test_transformers_serve_body_uses_only_accepted_fields() -> None:
    opts = BackendOptions(model="/m", stop=["END"])
    body = TransformersServeBackend(opts).body(BenchItem(2, "hi", 1, 9))
    # `transformers serve` answers 422 to fields outside the OpenAI schema (+ its own three).
    assert set(body) <= {"model", "prompt", "max_tokens", "stream", "generation_config",
                         "temperature", "seed", "stop"}
    assert body["max_tokens"] == 9 and body["stream"] is True and body["model"] == "/m"
    gen = json.loads(body["generation_config"])
    assert gen["min_new_tokens"] == gen["max_new_tokens"] == 9


def test_sse_over_chunked_http() -> None:
    events = [{"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo"}]},
              {"choices": [{"text": "", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
    sse = "".join(f"data: {json.dumps(e)}\r\n\r\n" for e in events) + "data: [DONE]\n\n"
    raw = sse.encode()
    # Chunk boundaries that cut events, lines and a CRLF in half.
    pieces = [raw[:7], raw[7:40], raw[40:41], raw[41:]]
    body = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")

    async def go() -> tuple[int, list[str]]:
        reader = asyncio.StreamReader()
        reader.feed_data(head + body)
        reader.feed_eof()
        status, headers, chunks = await read_http_response(reader)
        assert headers["transfer-encoding"] == "chunked"
        return status, [e async for e in sse_events(chunks)]

    status, got = asyncio.run(go())
    assert status == 200
    assert got[-1] == "[DONE]"
    assert [json.loads(g) for g in got[:-1]] == events
