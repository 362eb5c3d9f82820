"""The HTTP API's uvicorn server on a thread of its own, over a scripted frontend: what the
app tests and the agent tests drive with real HTTP clients."""
from __future__ import annotations

import asyncio
import functools
import socket
import threading

from fastapi import FastAPI

from tandem_serve.openai_api.server import HTTPServer
from tandem_serve.proto.config import ServerConfig
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import sentencepiece_dir


@functools.cache
def tok() -> Tokenizer:
    return Tokenizer.from_dir(str(sentencepiece_dir()))


class ThreadedServer:
    """`app` served on a free loopback port (`url`) from its own event loop and thread."""

    def __init__(self, app: FastAPI) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = HTTPServer(app, sock, ServerConfig(model="/models/tiny"))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
