"""Two Tandem replicas behind a real sglang-router (the Rust one, from PyPI) on loopback.

One multi-turn workload per routing policy, each through its own router in front of the same
two replicas: 8 conversations of 5 turns, every turn's prompt the whole conversation so far,
the conversations at once.  Every request is answered, greedy output equals a direct request
to a replica, both replicas serve, and each replica's own vLLM-named metrics count what it
served (`vllm:request_success_total`) and what its prefix cache saved
(`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`).

Each policy's conversations start with words of their own, so neither run finds the other's
prompts cached, and a conversation's first KV block already names it, so no conversation
finds another's.  The most any policy can save is then what keeping each conversation on one
replica saves, which is what cache-aware routing does at this load (its load balancing starts
when the replicas' loads differ by more than 64 requests; 8 run at once): so it saves at least
as much as round robin, whatever the interleaving.  Measured on 2 shared cores over 7 runs:
cache-aware took 71.2% of the prompt tokens from the cache every time, round robin
49.7-52.9%; both split the 40 requests 20/20.

Then `tandem bench serve --replica-url` (a CLI run: only tests/bench may import bench) sends
a few requests through the round-robin router and reports both replicas' counts.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tandem_serve.harness.metrics_scrape import Scrape
from tandem_serve.ipc.process import CLI
from tests.e2e.server import Server, free_port

pytestmark = pytest.mark.slow
pytest.importorskip("sglang_router")

MODEL = "tiny"
POLICIES = ("cache_aware", "round_robin")
CONVERSATIONS, TURNS, MAX_TOKENS = 8, 5, 8
BENCH_PROMPTS = 8


@dataclass
class Fleet:
    replicas: list[Server]
    routers: dict[str, str]  # policy -> the router's base URL

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.replicas[i].http_port}"


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def registered(url: str) -> list[str]:
    """The workers the router routes to: healthy, and listed by the model name their
    /server_info gave it."""
    try:
        with urllib.request.urlopen(url + "/workers", timeout=5) as r:
            workers = json.loads(r.read())["workers"]
    except OSError:
        return []
    return [w["url"] for w in workers if w["is_healthy"] and w["model_id"] == MODEL]


def start_router(policy: str, workers: list[str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--worker-urls", *workers, "--policy", policy,
         # Its own metrics port: the default (29000) would be both routers', and anyone's.
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_routing(url: str, proc: subprocess.Popen[str], workers: list[str],
                 timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while sorted(registered(url)) != sorted(workers):
        if proc.poll() is not None:
            raise RuntimeError(f"router exited {proc.returncode}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "the router never registered both workers"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(fast_model_dir: pathlib.Path) -> Iterator[Fleet]:
    # One postproc worker each: fewer processes to start on a small host; routing does not
    # depend on them.
    replicas = [Server(str(fast_model_dir), "--served-model-name", MODEL,
                       "--num-postproc-workers", "1", http=True) for _ in range(2)]
    routers: list[subprocess.Popen[str]] = []
    try:
        for r in replicas:
            r.wait_ready()
        workers = [f"http://127.0.0.1:{r.http_port}" for r in replicas]
        urls = {}
        for policy in POLICIES:
            proc, urls[policy] = start_router(policy, workers)
            routers.append(proc)
        for proc, url in zip(routers, urls.values(), strict=True):
            wait_routing(url, proc, workers)
        yield Fleet(replicas, urls)
    finally:
        for proc in routers:
            proc.terminate()
            proc.wait(10)
        codes = [r.stop() for r in replicas]
    assert codes == [0, 0]


def complete(base: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = post(base + "/v1/completions", body)
    return str(reply["choices"][0]["text"])  # type: ignore[index]


def conversation(base: str, policy: str, c: int) -> list[tuple[str, str]]:
    """Every turn's (prompt, answer); a turn's prompt is the conversation so far."""
    history = f"{policy} conversation {c} about " + " ".join(f"topic{c}x{i}" for i in range(24))
    turns = []
    for t in range(TURNS):
        history += f"\nUser: tell me about part {t} of item {c}.\nAssistant:"
        answer = complete(base, history)
        turns.append((history, answer))
        history += answer
    return turns


@dataclass
class Run:
    turns: list[list[tuple[str, str]]]  # per conversation
    served: list[float]  # per replica
    queries: float
    hits: float


def scrape(fleet: Fleet) -> list[Scrape]:
    return [Scrape(fleet.replica_url(i) + "/metrics") for i in range(len(fleet.replicas))]


def unreported(s: Scrape) -> float:
    """Prompt tokens the scheduler has not reported querying the prefix cache for yet (plus
    a constant: the frontend's warm-up is queried but not counted as a client's prompt)."""
    return s.total("vllm:prompt_tokens_total") - s.total("vllm:prefix_cache_queries_total")


def settled(fleet: Fleet, before: list[Scrape]) -> list[Scrape]:
    """The replicas' metrics once the schedulers reported every prompt (every 0.2 s)."""
    deadline = time.monotonic() + 10
    while True:
        after = scrape(fleet)
        if all(unreported(a) == unreported(b) for a, b in zip(after, before, strict=True)) \
                or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def run(fleet: Fleet, policy: str) -> Run:
    before = scrape(fleet)
    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        turns = list(pool.map(lambda c: conversation(fleet.routers[policy], policy, c),
                              range(CONVERSATIONS)))
    after = settled(fleet, before)

    def moved(name: str) -> list[float]:
        return [a.total(name) - b.total(name) for a, b in zip(after, before, strict=True)]

    return Run(turns, moved("vllm:request_success_total"),
               sum(moved("vllm:prefix_cache_queries_total")),
               sum(moved("vllm:prefix_cache_hits_total")))


def test_replicas_behind_a_real_router(fleet: Fleet) -> None:
    runs = {policy: run(fleet, policy) for policy in POLICIES}
    for policy, r in runs.items():
        answered = sum(len(turns) for turns in r.turns)
        print(f"\n{policy}: {answered} requests answered, per replica "
              f"{[int(n) for n in r.served]}, prefix-cache hits {int(r.hits)} of "
              f"{int(r.queries)} prompt tokens ({r.hits / r.queries:.1%})")
        assert answered == CONVERSATIONS * TURNS  # an error would have raised
        assert sum(r.served) == answered, r.served  # each replica counted what it served
        assert all(n > 0 for n in r.served), f"{policy} used one replica only: {r.served}"
        assert r.hits > 0  # later turns find their conversation's earlier ones cached
    share = {policy: r.hits / r.queries for policy, r in runs.items()}
    assert share["cache_aware"] >= share["round_robin"], share
    # Greedy output through the router equals a direct request to either replica.
    last = [turns[-1] for turns in runs["cache_aware"].turns]
    for i, (prompt, answer) in enumerate(last):
        assert complete(fleet.replica_url(i % 2), prompt) == answer


def test_bench_serve_counts_each_replica_behind_the_router(
        fleet: Fleet, fast_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "result.json"
    urls = [fleet.replica_url(i) for i in range(len(fleet.replicas))]
    cmd = [*CLI, "bench", "serve", "--backend", "openai-completions",
           "--base-url", fleet.routers["round_robin"], "--model", str(fast_model_dir),
           "--served-model-name", MODEL, "--num-prompts", str(BENCH_PROMPTS),
           "--input-len", "16", "--output-len", "4", "--max-concurrency", "4",
           "--no-progress", "--output-json", str(out),
           *(arg for url in urls for arg in ("--replica-url", url))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    got = result["replicas"]
    print(f"\nbench serve via round_robin: {[r['requests'] for r in got]} requests per replica")
    assert [r["url"] for r in got] == urls
    assert result["completed"] == BENCH_PROMPTS
    assert sum(r["requests"] for r in got) == BENCH_PROMPTS
    assert all(r["requests"] > 0 for r in got), got
    # The replicas counted exactly the usage the benchmark was answered with.
    assert sum(r["prompt_tokens"] for r in got) == result["total_input_tokens"]
    assert sum(r["generation_tokens"] for r in got) == result["total_output_tokens"]
    assert all(r["settled"] for r in got), got  # every prompt reported as queried
    assert f" Replica 2: {urls[1]} " in done.stdout
