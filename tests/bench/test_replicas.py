"""`tandem bench serve --replica-url`: per-replica counts between two reads of each replica's
vLLM-named metrics, on fake expositions; then a whole run against fake replicas that serve
`/metrics` over real HTTP, whose prefix-cache counters lag as the scheduler's reports do."""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem_serve.bench.serve import replicas
from tandem_serve.bench.serve.backends.base import Backend, BackendOptions
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.main import add_arguments, config_from_args
from tandem_serve.bench.serve.metrics import WIDTH, RequestRecord
from tandem_serve.bench.serve.run import run_benchmark
from tandem_serve.harness.metrics_scrape import Scrape

REASONS = ("stop", "length", "abort")


def exposition(finished: dict[str, int], prompt: int, generation: int, queries: int,
               hits: int, prefix_caching: bool = True) -> str:
    """A replica's /metrics text, with the families and labels Tandem serves."""
    labels = 'engine="0",model_name="m"'
    lines = ["# TYPE vllm:request_success_total counter"]
    lines += [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} '
              f"{float(finished.get(r, 0))}" for r in REASONS]
    for name, value in (("prompt_tokens", prompt), ("generation_tokens", generation),
                        ("prefix_cache_queries", queries), ("prefix_cache_hits", hits)):
        lines += [f"# TYPE vllm:{name}_total counter",
                  f"vllm:{name}_total{{{labels}}} {float(value)}"]
    lines += ["# TYPE vllm:cache_config_info gauge",
              f'vllm:cache_config_info{{block_size="16",enable_prefix_caching='
              f'"{prefix_caching}",engine="0",num_gpu_blocks="64"}} 1.0']
    return "\n".join(lines) + "\n"


def fake(*args: object, **kwargs: object) -> Scrape:
    return Scrape("fake", exposition(*args, **kwargs))  # type: ignore[arg-type]


def test_counts_are_what_each_counter_moved_by() -> None:
    before = fake({"stop": 2, "length": 5}, 100, 40, 104, 16)
    after = fake({"stop": 3, "length": 12, "abort": 1}, 900, 200, 904, 336)
    c = replicas.replica_counts("http://r1", before, after)
    assert c.finished == {"stop": 1, "length": 7, "abort": 1} and c.requests == 9
    assert (c.prompt_tokens, c.generation_tokens) == (800, 160)
    assert (c.prefix_cache_queries, c.prefix_cache_hits) == (800, 320)
    assert c.prefix_cache_hit_rate == pytest.approx(0.4)
    out = json.loads(json.dumps(c.as_json(), allow_nan=False))
    assert out["url"] == "http://r1" and out["requests"] == 9 and out["settled"] is True
    assert out["prefix_cache_hit_rate"] == pytest.approx(0.4)


def test_an_idle_replica_has_no_hit_rate() -> None:
    s = fake({}, 10, 10, 10, 0)
    c = replicas.replica_counts("http://r", s, s)
    assert c.requests == 0 and c.finished == dict.fromkeys(REASONS, 0)
    assert c.prefix_cache_hit_rate is None


def test_caught_up_once_every_prompt_was_queried() -> None:
    before = fake({}, 100, 0, 104, 0)
    assert not replicas.caught_up(before, fake({}, 300, 0, 200, 0))  # 104 not reported yet
    assert replicas.caught_up(before, fake({}, 300, 0, 304, 0))
    assert replicas.caught_up(before, fake({}, 300, 0, 330, 0))  # a preempted one, requeried
    # No prefix cache, no queries ever: nothing to wait for.
    assert replicas.caught_up(before, fake({}, 300, 0, 104, 0, prefix_caching=False))


# ------------------------------------------------------------ a run against fake replicas


class FakeReplica:
    """A replica's counters on a real HTTP port; prompt tokens reach the prefix-cache queries
    only on the read after the one that first could have shown them (the report lag)."""

    def __init__(self, lag: bool = True) -> None:
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}
        self.prompt = self.generation = self.queries = self.hits = self.pending = 0
        self.lag = lag
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                body = replica.read().encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/"

    def serve(self, prompt: int, generation: int, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt += prompt
            self.generation += generation
            self.pending += prompt

    def read(self) -> str:
        with self.lock:
            text = exposition(self.finished, self.prompt, self.generation, self.queries,
                              self.hits)
            if self.lag:
                self.queries += self.pending
                self.hits += self.pending // 2
                self.pending = 0
            return text

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(5)


class RouterBackend(Backend):
    """A router in front of the fake replicas: request i goes to replica i mod n."""

    name = "fake"

    def __init__(self, fleet: list[FakeReplica]) -> None:
        super().__init__(BackendOptions())
        self.fleet = fleet

    async def run_one(self, item: BenchItem) -> RequestRecord:
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        await asyncio.sleep(0.001)
        rec.add_chunk(time.perf_counter(), item.output_len)
        rec.output_tokens, rec.success = item.output_len, True
        reason = "stop" if item.index % 3 == 0 else "length"
        if self.fleet:
            replica = self.fleet[item.index % len(self.fleet)]
            replica.serve(item.prompt_len, item.output_len, reason)
        return rec


@pytest.fixture
def fleet() -> Iterator[list[FakeReplica]]:
    replicas_ = [FakeReplica(), FakeReplica()]
    yield replicas_
    for r in replicas_:
        r.close()


def test_a_run_reports_what_each_replica_served(fleet: list[FakeReplica]) -> None:
    items = [BenchItem(i, f"prompt {i}", 10 + i, 4) for i in range(9)]
    config = BenchConfig(backend="fake", warmup=3, replica_urls=[r.url for r in fleet])
    result = asyncio.run(run_benchmark(config, items=items, backend=RouterBackend(fleet)))
    got = result["replicas"]
    assert [r["url"] for r in got] == [r.url.rstrip("/") for r in fleet]
    # The warm-up's three requests went to the replicas too, but are not counted.
    assert [r["requests"] for r in got] == [5, 4]
    assert sum(r["requests"] for r in got) == result["completed"] == 9
    assert got[0]["finished"] == {"stop": 2, "length": 3, "abort": 0}
    assert sum(r["prompt_tokens"] for r in got) == result["total_input_tokens"]
    assert sum(r["generation_tokens"] for r in got) == result["total_output_tokens"]
    # Read again until the lagging queries caught up: every prompt token was queried.
    assert all(r["settled"] and r["prefix_cache_queries"] == r["prompt_tokens"] for r in got)
    assert got[0]["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.01)
    json.dumps(result, allow_nan=False)
    block = replicas.format_summary(result).splitlines()
    assert block[0].startswith("-") and f" Replica 1: {got[0]['url']} " in block[0]
    assert "Requests finished:" in block[1] and block[1].split()[-1] == "5"
    assert all(len(line) <= WIDTH + 1 for line in block)
    assert block[-1] == "=" * WIDTH


def test_a_replica_that_never_catches_up_is_marked(fleet: list[FakeReplica]) -> None:
    fleet[1].lag = False  # its prefix-cache queries never move

    async def run() -> list[replicas.ReplicaCounts]:
        watch = replicas.ReplicaWatch([r.url for r in fleet], timeout=0.3)
        await watch.start()
        for r in fleet:
            r.serve(8, 2, "length")
        return await watch.finish()

    t0 = time.monotonic()
    counts = asyncio.run(run())
    assert time.monotonic() - t0 >= 0.3
    assert [c.settled for c in counts] == [True, False]
    assert [c.requests for c in counts] == [1, 1]
    result = replicas.summary(counts)
    assert "had not caught up" in replicas.format_summary(result)


def test_no_replica_urls_no_replicas_key() -> None:
    items = [BenchItem(i, "p", 5, 2) for i in range(2)]
    result = asyncio.run(run_benchmark(BenchConfig(backend="fake"), items=items,
                                       backend=RouterBackend([])))
    assert "replicas" not in result


def test_replica_url_flag_repeats() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    c = config_from_args(p.parse_args(["--backend", "openai-completions",
                                       "--replica-url", "http://a:1", "--replica-url",
                                       "http://b:2"]))
    assert c.replica_urls == ["http://a:1", "http://b:2"]
    assert config_from_args(p.parse_args([])).replica_urls == []
    with pytest.raises(ValueError, match="--replica-url"):
        asyncio.run(run_benchmark(BenchConfig(backend="hf-generate", replica_urls=["x"]),
                                  items=[BenchItem(0, "p", 5, 2)]))
