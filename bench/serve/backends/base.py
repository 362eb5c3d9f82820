"""The engines `tandem bench serve` can drive, behind one interface.

`Backend.run_one(item)` sends one request and returns its `RequestRecord`; it never raises
for a failed request (the record says `success=False` and why). Timestamps are
`time.perf_counter()`, taken when a message arrives, before any parsing beyond what is
needed to see whether it carried tokens.

* `tandem`: `fmaas.GenerationService/GenerateStream` over `grpc.aio`; thousands of streams
  share one event loop and one channel, no threads (`tandem.py`).
* `openai-completions` / `openai-chat`: any OpenAI-compatible server at `--base-url`
  (Tandem's HTTP API, vLLM, ...), streamed over SSE (`openai.py`).
* `transformers-serve`: the OpenAI-compatible `/v1/completions` SSE stream of
  `transformers serve`, through the same HTTP client (aiohttp when installed, else a small
  HTTP/1.1 client on asyncio: `http_sse.py`).
* `hf-generate`: no server; static batches of `model.generate()` in this process, the
  upper bound a server has to beat (or the floor it must not fall through:
  `hf_generate.py`).

This module holds the interface every one of them implements; `registry.make_backend`
builds any of them by name.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.metrics import RequestRecord

BACKENDS = ("tandem", "openai-completions", "openai-chat", "transformers-serve", "hf-generate")


@dataclass
class BackendOptions:
    """What every backend may honour; a backend ignores what it cannot express."""

    host: str = "127.0.0.1"
    port: int = 8033
    model: str = ""  # model folder (tokenizer, hf-generate weights)
    served_model_name: str = ""  # the "model" field of OpenAI requests
    base_url: str = ""  # OpenAI-compatible servers: scheme://host:port (else host and port)
    endpoint: str = ""  # OpenAI path; "": /v1/completions or /v1/chat/completions
    logprobs: int | None = None  # top-N logprobs per generated token
    stop: list[str] = field(default_factory=list)
    sample: bool = False
    temperature: float = 1.0
    seed: int = 0  # request i samples with seed + i
    request_timeout: float | None = None
    ready_timeout: float = 0.0  # wait this long for the server to report SERVING
    batch_size: int = 16  # hf-generate only
    device: str = "auto"  # hf-generate only
    dtype: str = "float32"  # hf-generate only
    adapters: list[str] = field(default_factory=list)  # tandem: request i uses i % n


class Progress:
    """Counters the progress line reads; plain ints, updated from the loop or one thread."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.done = 0
        self.failed = 0
        self.output_tokens = 0

    def add_tokens(self, n: int) -> None:
        self.output_tokens += n


class Backend:
    """One engine. `start()` before the first request, `close()` after the last."""

    name = "base"

    def __init__(self, opts: BackendOptions) -> None:
        self.opts = opts
        self.progress = Progress()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def run_one(self, item: BenchItem) -> RequestRecord:
        raise NotImplementedError


def fail_record(rec: RequestRecord, error: str) -> RequestRecord:
    rec.success = False
    rec.error = error
    rec.end_time = time.perf_counter()
    return rec
