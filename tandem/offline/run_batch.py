"""`tandem run-batch -i IN.jsonl -o OUT.jsonl --model DIR`: an OpenAI batch file, offline.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url
/v1/chat/completions or /v1/completions; each output line is OpenAI's batch output,
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in input
order.  The bodies go through the HTTP API's own application (`openai_api/app.py`), called
in-process without a socket, so a line's answer is the server's, byte for byte in its fields.

A line that fails does not stop the file (vLLM's run-batch aborts on the first): a line that
is not JSON, has no custom_id, or names a url this engine does not serve gets `response:
null` and an `error` with a code and a message; a body the API refuses gets its 400 answer as
the response.  Progress and a summary go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem_serve.proto.config import ServerConfig

if TYPE_CHECKING:  # every role process builds the CLI's parser: fastapi and the engine
    from fastapi import FastAPI  # load only when a batch runs (about a second of CPU each)

log = logging.getLogger("tandem.run_batch")

# The routes a batch line may name: generation's, and under --runner pooling the pooling
# ones (vLLM's run-batch takes the same; a line for the other runner gets the app's 400).
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True,
                   help="OpenAI batch input (JSONL: custom_id, method, url, body)")
    p.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL)")
    p.add_argument("--max-concurrency", type=int, default=0,
                   help="requests in flight at once (0: 4 x --max-num-seqs)")


@dataclass
class BatchLine:
    """One input line, parsed, or why it cannot run (`error`)."""

    number: int
    custom_id: str | None
    url: str = ""
    body: bytes = b""
    error: tuple[str, str] | None = None  # (code, message)


def parse_line(number: int, text: str) -> BatchLine:
    try:
        item = json.loads(text)
    except ValueError as exc:
        return BatchLine(number, None, error=("invalid_json", f"line {number}: {exc}"))
    if not isinstance(item, dict):
        return BatchLine(number, None, error=("invalid_request",
                                              f"line {number}: not a JSON object"))
    cid = item.get("custom_id")
    cid = cid if isinstance(cid, str) else None
    url, method, body = item.get("url"), item.get("method", "POST"), item.get("body")
    if cid is None:
        problem = ("missing_custom_id", "custom_id: a string is required")
    elif method != "POST":
        problem = ("invalid_method", f"method: only POST is supported, got {method!r}")
    elif url not in URLS:
        problem = ("invalid_url", f"url: must be one of {list(URLS)}, got {url!r}")
    elif not isinstance(body, dict):
        problem = ("invalid_body", "body: a JSON object is required")
    else:
        return BatchLine(number, cid, url, json.dumps(body).encode())
    return BatchLine(number, cid, error=problem)


async def call_app(app: FastAPI, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` to `path` (with any ?query) through the ASGI application, without a
    socket."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query.encode(), "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    delivered = False
    never = asyncio.Event()  # the client never goes away

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def output_line(line: BatchLine, status: int = 0, body: bytes = b"") -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id}
    if line.error is not None:
        code, message = line.error
        out.update(response=None, error={"code": code, "message": message})
        return out
    try:
        answer = json.loads(body)
    except ValueError:
        answer = {"error": {"message": body.decode(errors="replace")}}
    out.update(response={"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                         "body": answer}, error=None)
    return out


async def run_lines(app: FastAPI, lines: list[BatchLine], concurrency: int,
                    progress: Any) -> list[dict[str, Any]]:
    slots = asyncio.Semaphore(max(1, concurrency))

    async def one(line: BatchLine) -> dict[str, Any]:
        if line.error is not None:
            progress.update(1)
            return output_line(line)
        async with slots:
            status, body = await call_app(app, line.url, line.body)
        progress.update(1)
        return output_line(line, status, body)

    return list(await asyncio.gather(*(one(line) for line in lines)))


def summary(results: list[dict[str, Any]], seconds: float) -> str:
    outcome: Counter[str] = Counter()
    for r in results:
        if r["error"] is not None:
            outcome[r["error"]["code"]] += 1
        else:
            outcome[str(r["response"]["status_code"])] += 1
    ok = outcome.pop("200", 0)
    rest = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.items()))
    return (f"run-batch: {len(results)} requests in {seconds:.1f} s: {ok} succeeded, "
            f"{len(results) - ok} failed" + (f" ({rest})" if rest else ""))


def run(cfg: ServerConfig, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tandem_serve.tandem.offline.engine import BackgroundEngine

    with open(args.input_file, encoding="utf-8") as f:
        lines = [parse_line(n, text) for n, text in enumerate(f, 1) if text.strip()]
    t0 = time.monotonic()
    engine = BackgroundEngine(cfg.replace(http_port=0))
    try:
        app = engine.app()
        concurrency = args.max_concurrency or 4 * cfg.max_num_seqs
        with tqdm(total=len(lines), desc="run-batch", unit="req", file=sys.stderr) as bar:
            results = engine.call(run_lines(app, lines, concurrency, bar))
    finally:
        engine.close()
    with open(args.output_file, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(summary(results, time.monotonic() - t0) + f"; results in {args.output_file}",
          file=sys.stderr)
    return 0
