"""The host KV tier and vLLM's KV events through a real server with a small device cache:
a re-sent prompt comes back from the host (greedy output equal to HF's), concurrent requests
sharing prefixes under eviction equal HF, and a ZeroMQ subscriber decoding vLLM's schema
sees every change of the cache in order."""
from __future__ import annotations

import pathlib
import random
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from tandem_serve.harness.metrics_scrape import Scrape
from tandem_serve.rpc.client import GenerateOptions
from tests import kv_event_schema as vllm
from tests.e2e.server import Server, running
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta river stone cloud light seven orange tiger music".split()
BLOCK = 16
NUM_BLOCKS = 24  # 384 tokens: one long prompt evicts another


@pytest.fixture(scope="module")
def events_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tandem-kv-events-") as path:
        yield path


@pytest.fixture(scope="module")
def server(fast_model_dir: pathlib.Path, events_dir: str) -> Iterator[Server]:
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "ipc://{events_dir}/pub", "topic": "kv"}}')
    yield from running(str(fast_model_dir), "--num-kv-blocks", str(NUM_BLOCKS),
                       "--block-size", str(BLOCK), "--num-scheduler-steps", "4",
                       "--kv-offloading-size", "0.01", "--kv-events-config", config, http=True)


class Subscriber:
    """A SUB socket collecting (seq, KVEventBatch) decoded with vLLM's schema."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, vllm.KVEventBatch]] = []
        time.sleep(0.3)  # the subscription reaches the publisher

    def drain(self, quiet_s: float = 0.6) -> list[object]:
        events = []
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            batch = vllm.decode(payload)
            assert batch.data_parallel_rank == 0
            self.batches.append((int.from_bytes(seq, "big"), batch))
            events.extend(batch.events)
        return events


def text_of(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def generate(server: Server, text: str, n: int) -> str:
    opts = GenerateOptions(max_new_tokens=n, min_new_tokens=n)
    return "".join(r.text for r in server.client.stream(text, opts))


def counters(server: Server) -> tuple[float, float]:
    scrape = Scrape(f"http://127.0.0.1:{server.http_port}/metrics")
    return (scrape.total("vllm:external_prefix_cache_hits_total"),
            scrape.total("vllm:prefix_cache_hits_total"))


def settled(server: Server, before: tuple[float, float]) -> tuple[float, float]:
    """The counters once the scheduler's report (every 0.2 s) moved past `before`."""
    deadline = time.monotonic() + 5
    while counters(server) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    return counters(server)


def test_a_resent_prompt_comes_back_from_the_host_tier(
        server: Server, fast_model_dir: pathlib.Path, events_dir: str) -> None:
    from transformers import AutoTokenizer

    rng = random.Random(5)
    first, other = text_of(rng, 220), text_of(rng, 315)
    tokenizer = AutoTokenizer.from_pretrained(fast_model_dir)
    ids = tokenizer(first).input_ids
    full = (len(ids) - 1) // BLOCK  # the blocks a re-send can take from a cache
    # The other prompt takes (nearly) the whole device cache: the first one leaves it.
    assert full >= 10 and 360 <= len(tokenizer(other).input_ids) <= NUM_BLOCKS * BLOCK - 8
    want = hf_greedy(fast_model_dir, [(first, 8), (other, 8)])
    sub = Subscriber(f"ipc://{events_dir}/pub")
    assert generate(server, first, 8) == want[0]
    stored = [e for e in sub.drain() if isinstance(e, vllm.BlockStored)]
    # The prompt's full blocks, stored on the device with their tokens, chained by parent.
    gpu = [e for e in stored if e.medium == "GPU"]
    hashes = [h for e in gpu for h in e.block_hashes]
    assert len(hashes) >= full and [t for e in gpu for t in e.token_ids][:full * BLOCK] == \
        ids[:full * BLOCK]
    assert gpu[0].parent_block_hash is None and gpu[0].block_size == BLOCK
    for e in gpu[1:]:
        assert e.parent_block_hash == hashes[hashes.index(e.block_hashes[0]) - 1]
    before = counters(server)
    assert generate(server, other, 8) == want[1]  # evicts the first prompt's blocks
    events = sub.drain()
    removed = {h for e in events if isinstance(e, vllm.BlockRemoved) and e.medium == "GPU"
               for h in e.block_hashes}
    on_host = {h for e in events if isinstance(e, vllm.BlockStored) and e.medium == "CPU"
               for h in e.block_hashes}
    assert set(hashes[:full]) & removed and set(hashes[:full]) & removed <= on_host
    mid = settled(server, before)
    started = time.monotonic()
    assert generate(server, first, 8) == want[0]
    took = time.monotonic() - started
    after = settled(server, mid)
    host_hits = after[0] - mid[0]
    assert host_hits >= 0.9 * full * BLOCK, (host_hits, full, after[1] - mid[1], took)
    scrape = Scrape(f"http://127.0.0.1:{server.http_port}/metrics")
    assert 0 < scrape.total("tandem_kv_offload_usage_ratio") <= 1
    assert scrape.total("tandem_kv_offload_blocks") > full
    assert not [e for e in sub.drain() if isinstance(e, vllm.BlockStored)
                and e.medium == "GPU" and set(e.block_hashes) - set(hashes)], (
        "re-sending a prompt stored blocks it did not have before")
    # A prompt still on the device stores nothing new.
    assert generate(server, first, 8) == want[0]
    assert not [e for e in sub.drain() if isinstance(e, vllm.BlockStored)]
    seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in sequence numbers"


def test_concurrent_shared_prefixes_under_eviction_equal_hf(
        server: Server, fast_model_dir: pathlib.Path) -> None:
    rng = random.Random(9)
    prefixes = [text_of(rng, 120), text_of(rng, 90)]
    jobs = [(f"{prefixes[i % 2]} question {i}: {text_of(rng, rng.randint(2, 12))}", 12)
            for i in range(8)]
    want = hf_greedy(fast_model_dir, jobs)
    before = counters(server)
    for _ in range(2):  # the second round finds the prefixes on the device or the host
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: generate(server, *job), jobs))
        assert got == want
    assert settled(server, before)[0] > before[0], "no prefix came back from the host tier"
