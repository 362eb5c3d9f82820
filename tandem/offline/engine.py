"""The engine's processes started and watched from the caller's process, with the frontend's
part (engine client, tokenizer, validation, the rollout controls) on an event loop in a
background thread: what the offline `LLM` and `tandem run-batch` drive.

The process set is `tandem serve`'s (`tandem/launcher.py`: scheduler, gpu worker ranks,
postproc workers), reached over the same channels; only the servers are missing.  No port
is bound: requests go to the engine client directly.  A process that dies fails every open
request with the reason; `close()` (also at interpreter exit) stops every process and removes
the run folder, the sockets and the shared-memory ring.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI
from prometheus_client import REGISTRY

from tandem_serve.frontend import guided
from tandem_serve.frontend.engine_client import EngineClient
from tandem_serve.frontend.engine_control import EngineControls
from tandem_serve.frontend.frontend import Frontend, served_names
from tandem_serve.guided.service import GuidedCompiler
from tandem_serve.ipc.process import StartupError
from tandem_serve.openai_api.app import build_app
from tandem_serve.openai_api.chat.serving import Serving
from tandem_serve.openai_api.server import build_serving, pooling_app
from tandem_serve.proto.config import ServerConfig
from tandem_serve.tandem.launcher import Launcher
from tandem_serve.tandem.preflight import (
    adapter_store,
    check_model,
    check_pooling_model,
    load_tokenizer,
)
from tandem_serve.tandem.serve import engine_limits, warm_up, warm_up_pooling

log = logging.getLogger("tandem.offline")

T = TypeVar("T")


class BackgroundEngine:
    """The running engine; `call` runs a coroutine on its loop and waits for the result."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tandem-engine",
                                        daemon=True)
        self._thread.start()
        self.launcher: Launcher | None = None
        self._watching: asyncio.Task[None] | None = None
        self._closed = False
        atexit.register(self.close)
        try:
            self.call(self._start(cfg))
        except BaseException:
            self.close()
            raise

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("the engine was shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _start(self, cfg: ServerConfig) -> None:
        # The launcher pins its own process to the service cores on a CPU host; here that is
        # the caller's process, which keeps the cores it had.
        cpus = os.sched_getaffinity(0)
        launcher = self.launcher = Launcher(cfg)
        os.sched_setaffinity(0, cpus)
        cfg = self.cfg = launcher.cfg
        pooling = cfg.runner == "pooling"  # embeddings, rerank, score: no adapters, no guides
        if pooling:
            check_pooling_model(cfg.model)
            adapters = None
        else:
            adapters = adapter_store(cfg, check_model(cfg.model, cfg.tensor_parallel_size))
        tok = load_tokenizer(cfg.model)
        engine = EngineClient(cfg, served_names(cfg)[0])
        engine.start()
        self.frontend = Frontend(engine, tok, adapters)
        # The children are started from this (the engine's) thread, and a child's
        # PR_SET_PDEATHSIG fires when the thread that started it ends: the thread lives as
        # long as the engine, so they go with it.  They ignore SIGINT, so a Ctrl-C that
        # interrupts `generate` leaves the engine usable.
        failed = launcher.start()
        self._watching = asyncio.create_task(launcher.watch(None))
        ready: asyncio.Future[Any] = asyncio.ensure_future(engine.ready.wait())
        first: set[asyncio.Future[Any]] = {ready, failed}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            raise StartupError(launcher.startup_error or failed.result())
        failed.add_done_callback(lambda f: engine.fail_all(f.result()))
        assert engine.limits is not None
        if not pooling:
            self.frontend.guided = await asyncio.to_thread(
                GuidedCompiler.for_tokenizer, tok, guided.settings(cfg, engine.limits.vocab_size))
        self.frontend.limits = engine_limits(cfg, engine, tok)
        await (warm_up_pooling(engine, tok) if pooling else warm_up(engine, tok))
        self.frontend.serving = True
        self.controls = EngineControls(engine)
        self.serving: Serving = build_serving(cfg, self.frontend)
        log.info("engine ready: %s", cfg.model)

    def app(self) -> FastAPI:
        """The HTTP API's app over this engine, served in-process (`tandem run-batch`): the
        pooling routes under --runner pooling, else completions and chat."""
        if self.cfg.runner == "pooling":
            return pooling_app(self.cfg, self.frontend, REGISTRY)
        return build_app(self.serving)

    async def _stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            frontend.serving = frontend.accepting = False
            if frontend.guided is not None:
                await frontend.guided.close()
            frontend.engine.close()
        if self.launcher is not None:
            self.launcher.stop(failed=False)

    def close(self) -> None:
        """Stop every process and remove their files; idempotent."""
        if self._closed:
            return
        try:
            if self._thread.is_alive():
                self.call(self._stop(), timeout=60)
        except Exception:  # noqa: BLE001 - the cleanup below still runs
            log.warning("engine shutdown failed", exc_info=True)
        finally:
            self._closed = True
            if self.launcher is not None:
                self.launcher.cleanup()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            atexit.unregister(self.close)
