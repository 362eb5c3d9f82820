"""The engines `tandem bench serve` can drive, behind one interface.

`Backend.run_one(item)` sends one request and returns its `RequestRecord`; it never raises
for a failed request (the record says `success=False` and why). Timestamps are
`time.perf_counter()`, taken when a message arrives, before any parsing beyond what is
needed to see whether it carried tokens.

* `tandem`: `fmaas.GenerationService/GenerateStream` over `grpc.aio`; thousands of streams
  share one event loop and one channel, no threads.
* `openai-completions` / `openai-chat`: any OpenAI-compatible server at `--base-url`
  (Tandem's HTTP API, vLLM, ...), streamed over SSE (`bench/openai_backends.py`).
* `transformers-serve`: the OpenAI-compatible `/v1/completions` SSE stream of
  `transformers serve`, through the same HTTP client (aiohttp when installed, else a small
  HTTP/1.1 client on asyncio).
* `hf-generate`: no server; static batches of `model.generate()` in this process, the
  upper bound a server has to beat (or the floor it must not fall through).

This module holds the interface and the Tandem backend; the HTTP ones are in
`bench/openai_backends.py`, hf-generate in `bench/peer_backends.py`, and `make_backend`
builds any of them by name.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tandem_serve.bench.datasets import BenchItem
from tandem_serve.bench.metrics import RequestRecord

log = logging.getLogger("tandem.bench")

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


# ------------------------------------------------------------------------------ tandem


class TandemBackend(Backend):
    """gRPC GenerateStream with a fixed output length (min_new_tokens = max_new_tokens)."""

    name = "tandem"

    def __init__(self, opts: BackendOptions) -> None:
        super().__init__(opts)
        self._channel: Any = None
        self._stub: Any = None

    async def start(self) -> None:
        import grpc

        from tandem_serve.proto import generation_pb2_grpc as pb_grpc

        target = f"{self.opts.host}:{self.opts.port}"
        self._channel = grpc.aio.insecure_channel(
            target, options=[("grpc.max_receive_message_length", 64 << 20),
                             ("grpc.max_send_message_length", 64 << 20)])
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        if self.opts.ready_timeout > 0:
            await self._wait_ready(self.opts.ready_timeout)

    async def _wait_ready(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        req = health_pb2.HealthCheckRequest(service="fmaas.GenerationService")
        while True:
            try:
                resp = await health.Check(req, timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.opts.host}:{self.opts.port} not SERVING after "
                                   f"{timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def request(self, item: BenchItem) -> Any:
        from tandem_serve.proto import generation_pb2 as pb
        from tandem_serve.rpc.client import GenerateOptions

        opts = GenerateOptions(max_new_tokens=item.output_len, min_new_tokens=item.output_len,
                               stop_sequences=list(self.opts.stop))
        if item.guided:  # the constraint says when the output is complete (EOS)
            opts = dataclasses.replace(opts, min_new_tokens=0, **item.guided)
        if self.opts.sample:
            opts.sample = True
            opts.temperature = self.opts.temperature
            opts.seed = self.opts.seed + item.index
        if self.opts.logprobs is not None:
            # Token detail is the postprocessing load to measure: text, logprob, top-N.
            opts.generated_tokens = True
            opts.token_logprobs = True
            opts.top_n_tokens = self.opts.logprobs
        req = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=item.prompt),
                                         params=opts.to_proto())
        if self.opts.adapters:
            req.adapter_id = self.opts.adapters[item.index % len(self.opts.adapters)]
        return req

    async def run_one(self, item: BenchItem) -> RequestRecord:
        import grpc

        from tandem_serve.proto import generation_pb2 as pb

        req = self.request(item)
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        text: list[str] = []
        generated = 0
        stop_reason = 0
        try:
            call = self._stub.GenerateStream(
                req, timeout=self.opts.request_timeout,
                metadata=(("x-correlation-id", f"bench-{item.index}"),))
            async for resp in call:
                now = time.perf_counter()
                if resp.generated_token_count > generated:
                    # The cumulative count, not len(tokens): with multi-step streaming one
                    # message carries several tokens, and detail may be off.
                    new = resp.generated_token_count - generated
                    generated = resp.generated_token_count
                    rec.add_chunk(now, new)
                    self.progress.add_tokens(new)
                if resp.input_token_count:
                    rec.input_tokens = resp.input_token_count
                if resp.text:
                    text.append(resp.text)
                if resp.stop_reason:
                    stop_reason = resp.stop_reason
        except grpc.aio.AioRpcError as e:
            return fail_record(rec, f"{e.code().name}: {e.details()}")
        except Exception as e:  # a bench must report, not die, when one stream breaks
            return fail_record(rec, f"{type(e).__name__}: {e}")
        rec.end_time = time.perf_counter()
        rec.output_tokens = generated
        rec.generated_text = "".join(text)
        if stop_reason == pb.ERROR:
            return fail_record(rec, "stop_reason ERROR")
        rec.success = True
        return rec


def make_backend(name: str, opts: BackendOptions, tokenizer: Any = None) -> Backend:
    if name == "tandem":
        return TandemBackend(opts)
    # The other backends build on the classes above, so they are imported once one is chosen.
    from tandem_serve.bench.openai_backends import OpenAIBackend
    from tandem_serve.bench.peer_backends import HFGenerateBackend, TransformersServeBackend

    if name in ("openai-completions", "openai-chat"):
        return OpenAIBackend(opts, chat=name == "openai-chat")
    if name == "transformers-serve":
        return TransformersServeBackend(opts)
    if name == "hf-generate":
        return HFGenerateBackend(opts, tokenizer)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
