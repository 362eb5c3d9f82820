"""The engines `tandem bench serve` can drive, behind one interface.

`Backend.run_one(item)` sends one request and returns its `RequestRecord`; it never raises
for a failed request (the record says `success=False` and why). Timestamps are
`time.perf_counter()`, taken when a message arrives, before any parsing beyond what is
needed to see whether it carried tokens.

* `tandem`: `fmaas.GenerationService/GenerateStream` over `grpc.aio`; thousands of streams
  share one event loop and one channel, no threads.
* `transformers-serve`: the OpenAI-compatible `/v1/completions` SSE stream of
  `transformers serve` (aiohttp when installed, else a small HTTP/1.1 client on asyncio).
* `hf-generate`: no server; static batches of `model.generate()` in this process, the
  upper bound a server has to beat (or the floor it must not fall through).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rpc.bench_datasets import BenchItem
from rpc.bench_metrics import RequestRecord

log = logging.getLogger("tandem.bench")

BACKENDS = ("tandem", "transformers-serve", "hf-generate")


@dataclass
class BackendOptions:
    """What every backend may honour; a backend ignores what it cannot express."""

    host: str = "127.0.0.1"
    port: int = 8033
    model: str = ""  # model folder (tokenizer, hf-generate weights)
    served_model_name: str = ""  # the "model" field of OpenAI requests
    endpoint: str = "/v1/completions"
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


def _fail(rec: RequestRecord, error: str) -> RequestRecord:
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

        from proto import generation_pb2_grpc as pb_grpc

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
        from proto import generation_pb2 as pb
        from rpc.client import GenerateOptions

        opts = GenerateOptions(max_new_tokens=item.output_len, min_new_tokens=item.output_len,
                               stop_sequences=list(self.opts.stop))
        if self.opts.sample:
            opts.sample = True
            opts.temperature = self.opts.temperature
            opts.seed = self.opts.seed + item.index
        if self.opts.logprobs is not None:
            # Token detail is the postprocessing load to measure: text, logprob, top-N.
            opts.generated_tokens = True
            opts.token_logprobs = True
            opts.top_n_tokens = self.opts.logprobs
        return pb.SingleGenerationRequest(request=pb.GenerationRequest(text=item.prompt),
                                          params=opts.to_proto())

    async def run_one(self, item: BenchItem) -> RequestRecord:
        import grpc

        from proto import generation_pb2 as pb

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
            return _fail(rec, f"{e.code().name}: {e.details()}")
        except Exception as e:  # a bench must report, not die, when one stream breaks
            return _fail(rec, f"{type(e).__name__}: {e}")
        rec.end_time = time.perf_counter()
        rec.output_tokens = generated
        rec.generated_text = "".join(text)
        if stop_reason == pb.ERROR:
            return _fail(rec, "stop_reason ERROR")
        rec.success = True
        return rec


# ------------------------------------------------------------------- HTTP + SSE client


class HTTPError(Exception):
    pass


async def _read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size_line = await reader.readline()
        if not size_line:
            raise HTTPError("connection closed inside a chunked body")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            # Trailers (usually none) end with an empty line.
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            return
        data = await reader.readexactly(size)
        await reader.readline()  # the CRLF after the chunk
        yield data


async def read_http_response(reader: asyncio.StreamReader
                             ) -> tuple[int, dict[str, str], AsyncIterator[bytes]]:
    """Status, lower-cased headers and the body as an async byte iterator."""
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise HTTPError(f"bad status line {status_line!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()

    async def body() -> AsyncIterator[bytes]:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            async for data in _read_chunked(reader):
                yield data
        elif "content-length" in headers:
            remaining = int(headers["content-length"])
            while remaining > 0:
                data = await reader.read(min(remaining, 65536))
                if not data:
                    raise HTTPError("connection closed before content-length bytes")
                remaining -= len(data)
                yield data
        else:
            while data := await reader.read(65536):
                yield data

    return status, headers, body()


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream, one per event."""
    buf = b""
    data_lines: list[str] = []
    async for chunk in chunks:
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line = buf[:nl].rstrip(b"\r").decode("utf-8")
            buf = buf[nl + 1:]
            if not line:
                if data_lines:
                    yield "\n".join(data_lines)
                    data_lines = []
            elif line.startswith("data:"):
                value = line[5:]
                data_lines.append(value[1:] if value.startswith(" ") else value)
            # comments (":") and other fields (event:, id:, retry:) carry nothing we need
    if data_lines:
        yield "\n".join(data_lines)


async def _post_sse_asyncio(host: str, port: int, path: str, body: dict[str, Any]
                            ) -> AsyncIterator[str]:
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
        writer.write(head.encode("latin-1") + payload)
        await writer.drain()
        status, _headers, chunks = await read_http_response(reader)
        if status != 200:
            detail = b"".join([c async for c in chunks]).decode("utf-8", "replace")
            raise HTTPError(f"HTTP {status}: {detail[:500]}")
        async for event in sse_events(chunks):
            yield event
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class TransformersServeBackend(Backend):
    """`transformers serve` `/v1/completions`, streamed.

    Its request schema rejects unknown fields (no `min_tokens`/`ignore_eos`), so the fixed
    output length goes in its `generation_config` JSON field: min_new_tokens =
    max_new_tokens = output_len, which suppresses EOS until the length is reached.
    """

    name = "transformers-serve"

    def __init__(self, opts: BackendOptions) -> None:
        super().__init__(opts)
        self._session: Any = None
        try:
            import aiohttp  # noqa: F401
            self._use_aiohttp = True
        except ImportError:
            self._use_aiohttp = False

    async def start(self) -> None:
        if self._use_aiohttp:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=self.opts.request_timeout or 6 * 3600))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, item: BenchItem) -> dict[str, Any]:
        gen: dict[str, Any] = {"max_new_tokens": item.output_len,
                               "min_new_tokens": item.output_len,
                               "do_sample": self.opts.sample}
        body: dict[str, Any] = {
            "model": self.opts.served_model_name or self.opts.model,
            "prompt": item.prompt,
            "max_tokens": item.output_len,
            "stream": True,
            "generation_config": json.dumps(gen),
        }
        if self.opts.sample:
            body["temperature"] = self.opts.temperature
            body["seed"] = self.opts.seed + item.index
        else:
            body["temperature"] = 0.0
        if self.opts.stop:
            body["stop"] = list(self.opts.stop)
        return body

    async def _events(self, body: dict[str, Any]) -> AsyncIterator[str]:
        if self._session is None:
            async for e in _post_sse_asyncio(self.opts.host, self.opts.port,
                                             self.opts.endpoint, body):
                yield e
            return
        url = f"http://{self.opts.host}:{self.opts.port}{self.opts.endpoint}"
        async with self._session.post(url, json=body) as resp:
            if resp.status != 200:
                raise HTTPError(f"HTTP {resp.status}: {(await resp.text())[:500]}")

            async def chunks() -> AsyncIterator[bytes]:
                async for data in resp.content.iter_any():
                    yield data

            async for e in sse_events(chunks()):
                yield e

    async def run_one(self, item: BenchItem) -> RequestRecord:
        body = self.body(item)
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        text: list[str] = []
        counted = 0
        usage_tokens: int | None = None

        async def consume() -> None:
            nonlocal counted, usage_tokens
            async for event in self._events(body):
                now = time.perf_counter()
                if event.strip() == "[DONE]":
                    break
                data = json.loads(event)
                if "error" in data:
                    raise HTTPError(str(data["error"]))
                for choice in data.get("choices") or ():
                    piece = choice.get("text") or ""
                    if piece:
                        # SSE chunks carry text, not token ids: one chunk is one token here,
                        # the usage block at the end gives the true total.
                        rec.add_chunk(now, 1)
                        counted += 1
                        self.progress.add_tokens(1)
                        text.append(piece)
                usage = data.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    if usage.get("prompt_tokens"):
                        rec.input_tokens = int(usage["prompt_tokens"])

        try:
            if self.opts.request_timeout:
                await asyncio.wait_for(consume(), self.opts.request_timeout)
            else:
                await consume()
        except Exception as e:  # report the request as failed, keep the benchmark going
            return _fail(rec, f"{type(e).__name__}: {e}")
        rec.end_time = time.perf_counter()
        rec.output_tokens = int(usage_tokens) if usage_tokens is not None else counted
        rec.generated_text = "".join(text)
        rec.success = True
        return rec


# ----------------------------------------------------------------------- hf-generate


class _StepTimes:
    """A `generate()` streamer that records when each decode step's tokens exist on the host."""

    def __init__(self, progress: Progress, output_lens: Sequence[int]) -> None:
        self.times: list[float] = []
        self._seen_prompt = False
        self._progress = progress
        self._output_lens = list(output_lens)

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if not self._seen_prompt:  # generate() first hands over the prompt ids
            self._seen_prompt = True
            return
        step = len(self.times)
        self.times.append(now)
        # Only rows still inside their own output length produce tokens anyone asked for.
        self._progress.add_tokens(sum(1 for n in self._output_lens if n > step))

    def end(self) -> None:
        return None


class HFGenerateBackend(Backend):
    """Static batching with `model.generate()` in this process; no server, no network.

    Requests queue up; whenever the model is idle it takes up to `batch_size` of them as one
    batch (left-padded), generates max(output_len) tokens with min_new_tokens equal to it,
    and reports each request's tokens at the decode step that produced them. TTFT is the
    batch's first step (prefill + one token) since the request was queued.
    """

    name = "hf-generate"

    def __init__(self, opts: BackendOptions, tokenizer: Any = None) -> None:
        super().__init__(opts)
        self._tok = tokenizer
        self._model: Any = None
        self._device: Any = None
        self._queue: asyncio.Queue[tuple[BenchItem, RequestRecord, asyncio.Future[None]]] | None
        self._queue = None
        self._worker: asyncio.Task[None] | None = None
        self._stop_tokenizer: Any = None

    async def start(self) -> None:
        if not self.opts.model:
            raise ValueError("hf-generate needs --model DIR")
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._batcher())

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self._tok is None:
            from rpc.tokenizer import Tokenizer

            self._tok = Tokenizer.from_dir(self.opts.model)
        device = self.opts.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        dtype = getattr(torch, self.opts.dtype) if self.opts.dtype != "auto" else "auto"
        self._model = AutoModelForCausalLM.from_pretrained(self.opts.model, dtype=dtype)
        self._model.to(self._device).eval()
        if self.opts.stop:
            # generate()'s stop_strings needs an HF tokenizer to map strings to tokens.
            from transformers import AutoTokenizer

            self._stop_tokenizer = AutoTokenizer.from_pretrained(self.opts.model)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    async def run_one(self, item: BenchItem) -> RequestRecord:
        assert self._queue is not None, "start() first"
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, rec, done))
        await done
        return rec

    async def _batcher(self) -> None:
        assert self._queue is not None
        q = self._queue
        while True:
            batch = [await q.get()]
            # Requests released together (a semaphore handing out slots, a burst) reach the
            # queue over a few loop turns; take them all before the model gets busy.
            still = 0
            while len(batch) + q.qsize() < self.opts.batch_size and still < 5:
                before = q.qsize()
                await asyncio.sleep(0)
                still = still + 1 if q.qsize() == before else 0
            while q.qsize() and len(batch) < self.opts.batch_size:
                batch.append(q.get_nowait())
            try:
                await asyncio.to_thread(self._generate, [(it, rec) for it, rec, _ in batch])
            except Exception as e:  # the whole batch failed together
                for _, rec, _ in batch:
                    _fail(rec, f"{type(e).__name__}: {e}")
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    def _generate(self, batch: Sequence[tuple[BenchItem, RequestRecord]]) -> None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        model, tok = self._model, self._tok
        prompts = [tok.encode(item.prompt) for item, _ in batch]
        width = max(len(p) for p in prompts)
        pad_id = model.generation_config.pad_token_id
        if pad_id is None:
            pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
        ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every row's last token lines up
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        n_new = max(item.output_len for item, _ in batch)
        streamer = _StepTimes(self.progress, [item.output_len for item, _ in batch])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=n_new, min_new_tokens=n_new, do_sample=self.opts.sample,
            pad_token_id=int(pad_id), streamer=streamer, top_k=None, top_p=None)
        if self.opts.sample:
            kwargs["temperature"] = self.opts.temperature
            torch.manual_seed(self.opts.seed + batch[0][0].index)
        else:
            kwargs["temperature"] = None
        if self.opts.logprobs is not None:
            n_top = self.opts.logprobs

            class _TopN(LogitsProcessor):
                # The work a server does for token detail: normalise, pick the top N.
                def __call__(self, input_ids: torch.Tensor,
                             scores: torch.Tensor) -> torch.Tensor:
                    lp = torch.log_softmax(scores.float(), dim=-1)
                    torch.topk(lp, max(n_top, 1), dim=-1)
                    return scores

            kwargs["logits_processor"] = LogitsProcessorList([_TopN()])
        if self._stop_tokenizer is not None:
            kwargs["stop_strings"] = list(self.opts.stop)
            kwargs["tokenizer"] = self._stop_tokenizer
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(self._device),
                                 attention_mask=mask.to(self._device), **kwargs)
        gen = out[:, width:].cpu().tolist()
        times = streamer.times
        for row, (item, rec) in enumerate(batch):
            n = min(item.output_len, len(times), len(gen[row]))
            if self._stop_tokenizer is not None:
                # A row that hit a stop string was padded afterwards; its last real token
                # is the last non-pad one.
                while n > 0 and gen[row][n - 1] == pad_id:
                    n -= 1
            for t in times[:n]:
                rec.add_chunk(t, 1)
            rec.input_tokens = len(prompts[row])
            rec.output_tokens = n
            rec.generated_text = tok.decode(gen[row][:n], skip_special_tokens=True)
            rec.end_time = times[n - 1] if n else time.perf_counter()
            rec.success = True


def make_backend(name: str, opts: BackendOptions, tokenizer: Any = None) -> Backend:
    if name == "tandem":
        return TandemBackend(opts)
    if name == "transformers-serve":
        return TransformersServeBackend(opts)
    if name == "hf-generate":
        return HFGenerateBackend(opts, tokenizer)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
