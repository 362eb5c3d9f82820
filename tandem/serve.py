"""The frontend process: the gRPC service and the OpenAI-compatible HTTP API on one event loop.

Start-up: bind the ports, connect the engine client, have the supervisor start the engine's
processes (`tandem/launcher.py`; none for roles on their own), serve gRPC and
(`--http-port`) HTTP, and turn readiness on once every process has reported in and a
warm-up request has gone through.

Serving ends one of three ways (DESIGN.md section 5):
- SIGTERM/SIGINT: NOT_SERVING (HTTP /health 503) at once, new requests get UNAVAILABLE (HTTP
  503), in-flight ones finish up to `--shutdown-timeout`, exit 0; a second signal exits at
  once.
- A process of the engine failed (the supervisor says which): NOT_SERVING, every open
  stream ends with UNAVAILABLE naming the process, exit 1.  Roles on their own replace
  their set instead and keep serving (frontend/standalone.py).
- A process's start-up mistake: exit 2, the supervisor's line said by `tandem`.

This module assembles the process out of frontend/ and both APIs (`rpc/`, `openai_api/`), so
it lives in tandem/, beside the launcher: frontend/ is a library both APIs use.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2

from tandem_serve.frontend import guided
from tandem_serve.frontend.adapter_store import AdapterStore
from tandem_serve.frontend.engine_client import EngineClient
from tandem_serve.frontend.frontend import Frontend, served_names
from tandem_serve.frontend.metrics import exposition, serve_metrics
from tandem_serve.frontend.ports import bound_socket, check_ports
from tandem_serve.frontend.request_traces import RequestTraces
from tandem_serve.frontend.standalone import SetKeeper
from tandem_serve.frontend.validation import Limits
from tandem_serve.guided.service import GuidedCompiler
from tandem_serve.ipc.process import freeze_heap
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.request_params import OutputOptions, SamplingParams
from tandem_serve.rpc.grpc_server import add_services, bound_grpc_server, set_health
from tandem_serve.rpc.server import SERVICE_NAME
from tandem_serve.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tandem_serve.openai_api.server import HTTPServer

log = logging.getLogger("tandem.frontend")

FLUSH_WAIT = 1.0  # for failed streams to send their status before the gRPC server stops
GRPC_STOP_GRACE = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Supervisor(Protocol):
    """Whoever starts and watches the engine's processes (`tandem/launcher.py`).  It says
    what failed; what that means for the requests and the servers is the frontend's call."""

    startup_error: str | None  # a process's start-up mistake, in one line: exit status 2

    def start(self) -> asyncio.Future[str]:
        """Start the processes (none for roles on their own); the future is the first
        failure that ends the server."""

    async def watch(self, replace: Callable[[str], None] | None) -> None:
        """Read the processes' failure reports until cancelled: a failed process ends the
        server, or, given `replace`, has its set replaced (roles on their own)."""

    def stop(self, failed: bool) -> None:
        """Stop every process (quickly after a failure) and remove their files; idempotent."""


@dataclass
class Servers:
    """What the process serves on, and what it serves with."""

    frontend: Frontend
    grpc: grpc.aio.Server
    health: object  # the gRPC health servicer: liveness (service "") and readiness
    http: HTTPServer | None = None

    async def set_ready(self, ready: bool) -> None:
        await set_health(self.health, SERVICE_NAME, SERVING if ready else NOT_SERVING)

    async def not_serving(self) -> None:
        """Both health services off: readiness, then liveness."""
        await self.set_ready(False)
        await set_health(self.health, "", NOT_SERVING)


class FrontendMain:
    """The frontend process from start-up to exit (`serve`)."""

    def __init__(self, cfg: ServerConfig, supervisor: Supervisor) -> None:
        self.cfg = cfg
        self.supervisor = supervisor
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._signals = 0
        self._precompile: asyncio.Task[None] | None = None  # format=JSON, after readiness
        self.keeper: SetKeeper | None = None  # roles on their own: the set they serve as

    async def serve(self, tok: Tokenizer, adapters: AdapterStore | None) -> int:
        """Serve until a signal or a failure; a start-up mistake raises StartupError."""
        check_ports(self.cfg)
        server = bound_grpc_server(self.cfg)
        http_sock = bound_socket("--http-port", self.cfg.host, self.cfg.http_port) \
            if self.cfg.http_port else None
        engine = EngineClient(self.cfg, served_names(self.cfg)[0])
        engine.start()
        frontend = Frontend(engine, tok, adapters)
        if self.cfg.otlp_traces_endpoint:
            frontend.traces = RequestTraces(self.cfg.otlp_traces_endpoint,
                                            served_names(self.cfg)[0])
            engine.on_queue_times = frontend.traces.on_queue_times
        metrics = exposition(engine.vllm_metrics.registry)
        failed = self.supervisor.start()
        s = Servers(frontend, server, add_services(server, frontend))
        await server.start()
        if http_sock is not None:
            from tandem_serve.openai_api.server import create_http_server

            s.http = create_http_server(self.cfg, frontend, http_sock, metrics)
            await s.http.start()
        serve_metrics(self.cfg.metrics_port, metrics)
        await set_health(s.health, "", SERVING)
        await s.set_ready(False)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self._serve(s, failed)
        finally:
            await self._shut_down(s)
        return self.exit_code

    async def _serve(self, s: Servers, failed: asyncio.Future[str]) -> None:
        """From start-up to the end: readiness, then serving until a failure or a signal,
        then failing or draining what is still open."""
        become_ready = partial(self._become_ready, s)
        peers = None
        if self.cfg.standalone:  # roles on their own: keep a set serving (frontend/standalone.py)
            self.keeper = SetKeeper(self.cfg, s.frontend, partial(s.set_ready, False),
                                    become_ready)
        replace = self.keeper.break_set if self.keeper is not None else None
        watching = asyncio.create_task(self.supervisor.watch(replace))
        starting: asyncio.Task[Any]
        if self.keeper is not None:
            peers = asyncio.create_task(self.keeper.run())
            starting = asyncio.create_task(self.keeper.served.wait())
        else:
            starting = asyncio.create_task(become_ready())
        stopping = asyncio.create_task(self._stop.wait())
        try:
            await self._until_the_end(starting, failed, stopping)
            if self.supervisor.startup_error is not None:  # `tandem` says it; nothing served
                self.exit_code = 2
            elif failed.done():
                await self._fail_everything(s, failed.result())
            elif stopping.done():
                await self._drain(s, failed)
        finally:
            for task in (watching, starting, stopping, peers):
                if task is not None:
                    task.cancel()
            if starting.done() and not starting.cancelled():
                starting.exception()  # seen (a warm-up cut short by a failure): no GC warning

    async def _until_the_end(self, starting: asyncio.Task[Any], failed: asyncio.Future[str],
                             stopping: asyncio.Task[Any]) -> None:
        """Wait for start-up, then serve until a process fails or a signal comes."""
        failing = asyncio.ensure_future(failed)
        first: set[asyncio.Future[Any]] = {starting, failing, stopping}
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if starting in done and starting.exception() is None:
            serving: set[asyncio.Future[Any]] = {failing, stopping}
            await asyncio.wait(serving, return_when=asyncio.FIRST_COMPLETED)
        elif starting in done:
            log.error("start-up failed: %s", starting.exception())
            self.exit_code = 1
            await asyncio.wait({failing}, timeout=2.0)  # a dying process usually explains it
        starting.cancel()

    async def _shut_down(self, s: Servers) -> None:
        await s.not_serving()
        s.frontend.serving = False
        if s.http is not None:
            await s.http.stop()
        # Cancels whatever is still open after the grace, so stop never waits for long streams.
        await s.grpc.stop(grace=GRPC_STOP_GRACE)
        if self._precompile is not None:
            self._precompile.cancel()
        if s.frontend.guided is not None:
            await s.frontend.guided.close()  # its compile worker too
        s.frontend.engine.close()
        if s.frontend.traces is not None:  # the last spans, off the loop
            await asyncio.to_thread(s.frontend.traces.close)
        self.supervisor.stop(failed=self.exit_code != 0)

    # ------------------------------------------------------------------ readiness

    def _limits(self, engine: EngineClient, tok: Tokenizer) -> Limits:
        return engine_limits(self.cfg, engine, tok)

    async def _become_ready(self, s: Servers) -> None:
        frontend = s.frontend
        engine, tok = frontend.engine, frontend.tok
        await engine.ready.wait()
        assert engine.limits is not None
        pooling = self.cfg.runner == "pooling"  # nothing to guide: no text is generated
        if frontend.guided is None and not pooling:  # once: a replaced set keeps it
            # The vocabulary's fingerprint names compiled constraints: before any request.
            frontend.guided = await asyncio.to_thread(
                GuidedCompiler.for_tokenizer, tok,
                guided.settings(self.cfg, engine.limits.vocab_size))
        frontend.limits = self._limits(engine, tok)
        await (warm_up_pooling(engine, tok) if pooling else warm_up(engine, tok))
        freeze_heap()  # before the first client: no full collection walks start-up's objects
        await s.set_ready(True)
        frontend.serving = True
        http = f", HTTP on port {self.cfg.http_port}" if self.cfg.http_port else ""
        log.info("serving %s on %s:%d%s", self.cfg.model, self.cfg.host, self.cfg.port, http)
        if frontend.guided is not None and self.cfg.guided_precompile_json \
                and self._precompile is None:  # after readiness
            self._precompile = asyncio.create_task(frontend.guided.precompile_json())

    # ------------------------------------------------------------------ the end

    async def _fail_everything(self, s: Servers, message: str) -> None:
        engine = s.frontend.engine
        self.exit_code = 1
        s.frontend.serving = False
        await s.not_serving()
        log.error("%s; failing %d open requests and exiting", message, engine.num_in_flight)
        engine.fail_all(f"{message}; the server is shutting down")
        await _flush(engine)

    async def _drain(self, s: Servers, failed: asyncio.Future[str]) -> None:
        engine = s.frontend.engine
        await s.not_serving()
        s.frontend.accepting = False
        timeout = self.cfg.shutdown_timeout
        deadline = time.monotonic() + timeout
        log.info("draining %d in-flight requests (up to %g s)", engine.num_in_flight, timeout)
        while engine.num_in_flight and time.monotonic() < deadline:
            if failed.done():  # a process died while we drained
                await self._fail_everything(s, failed.result())
                return
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.warning("cancelling %d requests still running after the %g s shutdown timeout",
                        engine.num_in_flight, timeout)
            engine.fail_all(f"server shut down: the request did not finish within the "
                            f"{timeout:g} s shutdown timeout")
            await _flush(engine)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s received: draining (send again to exit at once)",
                     signal.Signals(sig).name)
            self._stop.set()
        else:
            log.warning("second signal: exiting now")
            self.supervisor.stop(failed=True)
            os._exit(128 + sig)


def engine_limits(cfg: ServerConfig, engine: EngineClient, tok: Tokenizer) -> Limits:
    """What requests are validated against, once the gpu worker reported in."""
    assert engine.limits is not None
    return Limits(max_model_len=engine.limits.max_model_len,
                  max_new_tokens=cfg.max_new_tokens,
                  default_max_new_tokens=cfg.default_max_new_tokens,
                  vocab_size=engine.limits.vocab_size,
                  eos_token_ids=tuple(tok.eos_token_ids),
                  include_stop_sequence=cfg.include_stop_sequence,
                  priority_scheduling=cfg.scheduling_policy == "priority")


async def warm_up(engine: EngineClient, tok: Tokenizer) -> None:
    """One short greedy request through every process before readiness turns on."""
    ids = tok.encode("warm up") or [0]
    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=list(tok.eos_token_ids))
    async for _ in engine.generate(ids, sampling, OutputOptions(), metered=False):
        pass


async def warm_up_pooling(engine: EngineClient, tok: Tokenizer) -> None:
    """One pooling request through the scheduler and the gpu worker before readiness."""
    await engine.pooler.run([tok.encode("warm up") or [0]], metered=False)


async def _flush(engine: EngineClient) -> None:
    """Give failed streams the moment they need to send their status before gRPC stops."""
    deadline = time.monotonic() + FLUSH_WAIT
    while engine.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)


async def serve(cfg: ServerConfig, supervisor: Supervisor, tok: Tokenizer,
                adapters: AdapterStore | None) -> int:
    """Run the frontend process until a signal or a failure; its exit status."""
    return await FrontendMain(cfg, supervisor).serve(tok, adapters)
