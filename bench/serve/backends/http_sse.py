"""A small HTTP/1.1 + server-sent-events client on plain asyncio.

The `transformers-serve` backend streams over aiohttp when it is installed and falls back to
this, so the benchmark needs nothing beyond the standard library to drive an HTTP server.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


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


async def post_sse_asyncio(host: str, port: int, path: str, body: dict[str, Any]
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
