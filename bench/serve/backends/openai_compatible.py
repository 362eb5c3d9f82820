"""HTTP backends of `tandem bench serve`: any OpenAI-compatible server, streamed over SSE.

* `openai-completions` / `openai-chat`: `/v1/completions` or `/v1/chat/completions` of any
  OpenAI-compatible server (Tandem's `--http-port`, vLLM, ...) at `--base-url`. A fixed
  output length is asked for with `min_tokens = max_tokens` (the vLLM extension Tandem
  honours too), and `stream_options.continuous_usage_stats` puts the completion tokens so
  far on every chunk, so a chunk carrying several tokens counts as several.
* `transformers-serve`: the same client, with the one body `transformers serve` accepts.

One client for all of them (aiohttp with keep-alive when installed, else the asyncio HTTP/1.1
client of `http_sse.py`), so Tandem over HTTP and its peers are measured alike.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from tandem_serve.bench.serve.backends.base import Backend, BackendOptions, fail_record
from tandem_serve.bench.serve.backends.http_sse import HTTPError, post_sse_asyncio, sse_events
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.metrics import RequestRecord


class OpenAIBackend(Backend):
    """`/v1/completions` (or, `chat`, `/v1/chat/completions`) of an OpenAI-compatible server."""

    name = "openai-completions"

    def __init__(self, opts: BackendOptions, chat: bool = False) -> None:
        super().__init__(opts)
        self.chat = chat
        if chat:
            self.name = "openai-chat"
        self._session: Any = None
        try:
            import aiohttp  # noqa: F401
            self._use_aiohttp = True
        except ImportError:
            self._use_aiohttp = False
        self.base = opts.base_url.rstrip("/") or f"http://{opts.host}:{opts.port}"
        default = "/v1/chat/completions" if chat else "/v1/completions"
        self.url = self.base + (opts.endpoint or default)
        if not self._use_aiohttp and urlsplit(self.url).scheme != "http":
            raise ValueError(f"{self.url}: without aiohttp only http:// URLs are supported")

    # ------------------------------------------------------------------ connection

    def _connector(self) -> Any:
        import aiohttp

        # Keep-alive, like the gRPC backend's one channel: no connection set-up per request.
        return aiohttp.TCPConnector(limit=0)

    async def start(self) -> None:
        if self._use_aiohttp:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=self._connector(),
                timeout=aiohttp.ClientTimeout(total=self.opts.request_timeout or 6 * 3600))
        if self.opts.ready_timeout > 0:
            await self._wait_ready(self.opts.ready_timeout)

    async def _wait_ready(self, timeout: float) -> None:
        """GET /health until 200 (Tandem and vLLM answer 503 while starting)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                await asyncio.to_thread(urllib.request.urlopen, self.base + "/health", None, 2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.base}/health not 200 after {timeout:.0f} s"
                                       ) from None
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ requests

    def body(self, item: BenchItem) -> dict[str, Any]:
        o = self.opts
        body: dict[str, Any] = {"model": o.served_model_name or o.model,
                                "max_tokens": item.output_len, "min_tokens": item.output_len,
                                "stream": True,
                                "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": item.prompt}]
        else:
            body["prompt"] = item.prompt
        if o.sample:
            body["temperature"] = o.temperature
            body["seed"] = o.seed + item.index
        else:
            body["temperature"] = 0.0
        if o.stop:
            body["stop"] = list(o.stop)
        if o.logprobs is not None:
            if self.chat:
                body["logprobs"], body["top_logprobs"] = True, o.logprobs
            else:
                body["logprobs"] = o.logprobs
        return body

    async def _events(self, body: dict[str, Any]) -> AsyncIterator[str]:
        if self._session is None:
            parts = urlsplit(self.url)
            async for e in post_sse_asyncio(parts.hostname or "127.0.0.1", parts.port or 80,
                                             parts.path, body):
                yield e
            return
        async with self._session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise HTTPError(f"HTTP {resp.status}: {(await resp.text())[:500]}")

            async def chunks() -> AsyncIterator[bytes]:
                async for data in resp.content.iter_any():
                    yield data

            async for e in sse_events(chunks()):
                yield e

    def _piece(self, choice: dict[str, Any]) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    async def run_one(self, item: BenchItem) -> RequestRecord:
        body = self.body(item)
        rec = RequestRecord(send_time=time.perf_counter(), input_tokens=item.prompt_len)
        text: list[str] = []
        counted = 0  # tokens seen so far, from the usage on each chunk when there is one
        final: int | None = None

        async def consume() -> None:
            nonlocal counted, final
            async for event in self._events(body):
                now = time.perf_counter()
                if event.strip() == "[DONE]":
                    break
                data = json.loads(event)
                if "error" in data:
                    raise HTTPError(str(data["error"]))
                choices = data.get("choices") or ()
                pieces = [self._piece(c) for c in choices]
                text.extend(pieces)
                usage = data.get("usage")
                if usage and usage.get("prompt_tokens"):
                    rec.input_tokens = int(usage["prompt_tokens"])
                if not choices:  # the last chunk: the usage of the whole request
                    if usage:
                        final = int(usage["completion_tokens"])
                    continue
                if usage and usage.get("completion_tokens") is not None:
                    new = int(usage["completion_tokens"]) - counted
                else:  # no usage per chunk: a chunk with text is one token
                    new = sum(1 for p in pieces if p)
                if new > 0:
                    counted += new
                    rec.add_chunk(now, new)
                    self.progress.add_tokens(new)

        try:
            if self.opts.request_timeout:
                await asyncio.wait_for(consume(), self.opts.request_timeout)
            else:
                await consume()
        except Exception as e:  # report the request as failed, keep the benchmark going
            return fail_record(rec, f"{type(e).__name__}: {e}")
        rec.end_time = time.perf_counter()
        rec.output_tokens = final if final is not None else counted
        rec.generated_text = "".join(text)
        rec.success = True
        return rec


class TransformersServeBackend(OpenAIBackend):
    """`transformers serve` `/v1/completions`, through the same client.

    Its request schema rejects unknown fields (no `min_tokens`, no `continuous_usage_stats`),
    so the fixed output length goes in its `generation_config` JSON field: min_new_tokens =
    max_new_tokens = output_len, which suppresses EOS until the length is reached.
    """

    name = "transformers-serve"

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
