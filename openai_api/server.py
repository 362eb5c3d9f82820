"""uvicorn serving the app on the frontend's own event loop, beside gRPC.

The frontend process (tandem/serve.py) binds the socket (a port in use is a one-line
start-up error, not uvicorn's `sys.exit`) and owns the signals: uvicorn's handlers stay off,
so SIGTERM drains HTTP and gRPC the same way (readiness 503, new requests 503, in-flight
ones finish), and `stop()` then closes the listener and waits for the connections to finish.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import jinja2
import uvicorn
from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry

from tandem_serve.frontend.engine_control import EngineControls
from tandem_serve.frontend.frontend import Frontend, served_names
from tandem_serve.frontend.media.fetch import MediaPolicy
from tandem_serve.frontend.media.images import Images
from tandem_serve.openai_api.agents.tools import AgentSettings
from tandem_serve.openai_api.app import build_app
from tandem_serve.openai_api.chat.chat_template import ChatTemplate
from tandem_serve.openai_api.chat.serving import Serving
from tandem_serve.openai_api.pooling.serving import PoolingServing
from tandem_serve.pooling.folder import PoolingSpec
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.vision import image_limit

log = logging.getLogger("tandem.http")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the frontend process's handlers drain every API


class HTTPServer:
    def __init__(self, app: FastAPI, sock: socket.socket, cfg: ServerConfig,
                 grace: int = 1) -> None:
        tls = dict(ssl_certfile=cfg.tls_cert or None, ssl_keyfile=cfg.tls_key or None)
        if cfg.tls_client_ca:
            tls.update(ssl_ca_certs=cfg.tls_client_ca)
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", server_header=False,
            timeout_graceful_shutdown=grace, timeout_keep_alive=30,
            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_client_ca else ssl.CERT_NONE,
            **tls)  # type: ignore[arg-type]
        self._server = _Server(config)
        # uvicorn says "Started/Finished server process" at INFO under the name uvicorn.error;
        # the frontend process's own lines say when we serve and stop.
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        self._sock = sock
        self._task: asyncio.Task[None] | None = None
        self.scheme = "https" if cfg.tls_cert else "http"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():  # a bad certificate, say: its exception says why
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop listening, let open responses finish for the grace period, then close."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._server.force_exit = True
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - logged: we are exiting anyway
            log.warning("HTTP server stopped with %s", exc)


def build_serving(cfg: ServerConfig, frontend: Frontend) -> Serving:
    """The completions and chat logic over `frontend`, with the model folder's chat template
    (also what `tandem run-batch` and the offline `LLM` run requests through)."""
    try:
        template = ChatTemplate.load(cfg.model, frontend.tok, cfg.chat_template)
    except jinja2.TemplateError as exc:  # completions still work; chat says why it cannot
        log.warning("the chat template of %s does not compile (%s): chat completions are "
                    "off", cfg.model, exc)
        template = None
    if template is None:
        log.info("%s has no chat template: /v1/chat/completions answers 400", cfg.model)
    agents = AgentSettings(cfg.enable_auto_tool_choice, cfg.tool_call_parser,
                           cfg.reasoning_parser)
    policy = MediaPolicy(cfg.allowed_local_media_path, image_limit(cfg.limit_mm_per_prompt))
    images = Images.for_model(cfg.model, policy)
    return Serving(frontend, served_names(cfg), template, agents, images)


def create_http_server(cfg: ServerConfig, frontend: Frontend, sock: socket.socket,
                       metrics: CollectorRegistry = REGISTRY) -> HTTPServer:
    """The OpenAI-compatible API on `sock`, with the model folder's chat template;
    `metrics`: what GET /metrics shows; the rollout controls with
    --enable-control-endpoints."""
    if cfg.runner == "pooling":  # embeddings, rerank, score; no chat
        return HTTPServer(pooling_app(cfg, frontend, metrics), sock, cfg)
    controls = EngineControls(frontend.engine) if cfg.enable_control_endpoints else None
    app = build_app(build_serving(cfg, frontend), metrics, cfg.api_key,
                    runtime_lora=cfg.allow_runtime_lora_updating and frontend.adapters is not None,
                    controls=controls)
    return HTTPServer(app, sock, cfg)


def pooling_app(cfg: ServerConfig, frontend: Frontend, metrics: CollectorRegistry) -> FastAPI:
    """A --runner pooling server's app: the folder's pooling spec behind the pooling routes."""
    names = served_names(cfg)
    serving = Serving(frontend, names, None, AgentSettings(False, "", ""))
    spec = PoolingSpec.read(cfg.model, cfg.max_model_len)
    return build_app(serving, metrics, cfg.api_key,
                     pooling=PoolingServing(frontend, spec, serving.models))
