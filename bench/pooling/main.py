"""`tandem bench pooling`: embeddings through `tandem serve --runner pooling` against
sentence-transformers' `encode()` in one process, on the same machine, one after the other.

The texts are short (5-15 words, seeded); the model is `--model` (a sentence-transformers
folder) or, by default, a random BERT of all-MiniLM-L6-v2's shape (6 layers, hidden 384),
so the compute per token is a real embedding model's.  Arms, each timed after a warm-up:

  * `encode()`: `SentenceTransformer(dir).encode(texts, batch_size=32)`, torch's default
    threads, nothing else running;
  * the server, HTTP `/v1/embeddings` through the `openai` client: one text per request with
    `--concurrency` requests in flight, and `--batch` texts per request.

The ratio is texts per second over `encode()`'s, the faster of torch's default threads and
one thread (on a shared machine one can win: no thread waits at a barrier behind another
that was preempted).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from tandem_serve.harness.server import serving
from tandem_serve.harness.tiny_pooling import MINILM, WORDS, build_pooling_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="",
                   help="a sentence-transformers folder (default: a random BERT of "
                        "all-MiniLM-L6-v2's shape)")
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=32,
                   help="requests in flight for the one-text-per-request arm")
    p.add_argument("--batch", type=int, default=32, help="texts per request in the batch arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-flags", default="", help="more `tandem serve` flags")
    p.add_argument("--output-json", default="bench_pooling.json")


def make_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) for _ in range(n)]


def time_encode(model: str, texts: list[str], threads: int = 0) -> float:
    """Seconds `encode()` takes (`threads`: torch's intra-op threads; 0: its default)."""
    import torch
    from sentence_transformers import SentenceTransformer

    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = SentenceTransformer(model, device="cpu")
        st.encode(texts[:32], batch_size=32)  # warm-up
        t0 = time.perf_counter()
        st.encode(texts, batch_size=32)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(default)


async def _requests(base_url: str, batches: list[list[str]], concurrency: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(batch: list[str]) -> None:
        async with gate:
            reply = await client.embeddings.create(input=batch, model="m")
            assert len(reply.data) == len(batch)

    await one(batches[0])  # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    seconds = time.perf_counter() - t0
    await client.close()
    return seconds


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    texts = make_texts(args.texts, args.seed)
    figures: dict[str, Any] = {
        "texts": len(texts), "model": args.model or "a random BERT of all-MiniLM-L6-v2's shape"}
    import torch

    figures["encode_threads"] = torch.get_num_threads()
    figures["encode_default_s"] = time_encode(model, texts)
    # On a shared machine one thread can beat two (no barrier waits behind a preempted
    # thread): the baseline is the faster of the two, never a slowed one.
    figures["encode_one_thread_s"] = time_encode(model, texts, threads=1)
    figures["encode_s"] = min(figures["encode_default_s"], figures["encode_one_thread_s"])
    flags = ["--runner", "pooling", "--served-model-name", "m", *args.server_flags.split()]
    with serving(model, flags, http=True, quiet=True) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1"
        singles = [[t] for t in texts]
        figures["server_single_s"] = asyncio.run(_requests(url, singles, args.concurrency))
        batches = [texts[i:i + args.batch] for i in range(0, len(texts), args.batch)]
        figures["server_batch_s"] = asyncio.run(_requests(url, batches, 4))
    return figures


def report(f: dict[str, Any], args: argparse.Namespace) -> str:
    n, base = f["texts"], f["encode_s"]
    rows = [(f"encode(batch_size=32), {f['encode_threads']} torch threads",
             f["encode_default_s"]),
            ("encode(batch_size=32), 1 torch thread", f["encode_one_thread_s"]),
            (f"tandem, 1 text per request, {args.concurrency} in flight", f["server_single_s"]),
            (f"tandem, {args.batch} texts per request, 4 in flight", f["server_batch_s"])]
    lines = [f"tandem bench pooling: {n} short texts, {f['model']}; ratio over the faster "
             f"encode()",
             f"{'arm':<52} {'seconds':>8} {'texts/s':>9} {'ratio':>6}"]
    for name, seconds in rows:
        lines.append(f"{name:<52} {seconds:>8.2f} {n / seconds:>9.0f} {base / seconds:>5.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="tandem-bench-pooling-") as tmp:
        model = args.model or str(build_pooling_model(Path(tmp) / "minilm", "bert",
                                                      max_seq_length=128, size=MINILM))
        figures = run(args, model)
    print(report(figures, args))
    with open(args.output_json, "w") as f:
        json.dump(figures, f, indent=2)
    return 0
