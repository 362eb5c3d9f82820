"""The FastAPI application: routes, OpenAI-shaped errors, the request body limit.

    GET  /v1/models, /v1/models/{model}   the served model (and its max_model_len), and its
                                          LoRA adapters (openai_api/models.py)
    POST /v1/completions                  prompt(s) -> text (JSON, or SSE with stream)
    POST /v1/chat/completions             messages -> assistant message (JSON or SSE)
    POST /v1/responses                    OpenAI's Responses API, text (openai_api/responses/)
    POST /v1/embeddings, /v1/rerank (/rerank, /v2/rerank), /score (/v1/score)
                                          --runner pooling (openai_api/pooling/)
    POST /v1/messages                     Anthropic's Messages API, and .../count_tokens
                                          (openai_api/anthropic/): errors in its shape
    POST /tokenize, /detokenize           vLLM's: text or a chat <-> token ids
                                          (openai_api/tokenize.py)
    GET  /health                          200 when serving; 503 while starting or draining
    GET  /live                            liveness: 503 when requests are open and no engine
                                          plan completed for --liveness-timeout seconds
                                          (frontend/liveness.py); 200 otherwise, draining too
    GET  /metrics                         every process's Prometheus metrics: tandem_* and
                                          vLLM's (frontend/vllm_metrics.py)
    GET  /server_info                     sglang's worker description, the part its router
                                          reads (the model's name)
    POST /v1/load_lora_adapter,           with --allow-runtime-lora-updating: serve a LoRA
         /v1/unload_lora_adapter          folder under a name (openai_api/lora_admin.py)
    POST /sleep, /wake_up, /pause, ...    the rollout controls, with --enable-control-endpoints
                                          (openai_api/control.py)

Why FastAPI: pydantic request models give exact per-field errors for free, and it is what
vLLM serves its OpenAI API with, so clients meet the same behaviour at the edges.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem_serve.frontend.engine_control import EngineControls
from tandem_serve.frontend.request_traces import CALLER_TRACE, caller_headers
from tandem_serve.openai_api.anthropic.protocol import CountTokensRequest, MessagesRequest
from tandem_serve.openai_api.anthropic.protocol import error_body as anthropic_error
from tandem_serve.openai_api.anthropic.serving import count_tokens, create_message
from tandem_serve.openai_api.auth import ApiKeyGuard
from tandem_serve.openai_api.chat.serving import Serving
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.lora_admin import add_lora_routes
from tandem_serve.openai_api.pooling.routes import RunnerRoutes, add_pooling_routes
from tandem_serve.openai_api.pooling.serving import PoolingServing
from tandem_serve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tandem_serve.openai_api.responses.protocol import ResponsesRequest
from tandem_serve.openai_api.responses.serving import respond
from tandem_serve.openai_api.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)

log = logging.getLogger("tandem.http")

ANTHROPIC_PREFIX = "/v1/messages"
MAX_BODY_BYTES = 64 << 20  # as the gRPC server's max_receive_message_length
# Names pydantic puts in an error's location for the members of a union type.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class BodyLimit:
    """413 for a request body over `limit` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send, scope.get("path", ""))
            return
        seen = 0

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counting, send)

    async def _too_large(self, send: Send, path: str) -> None:
        response = error_response(ApiError(413, f"request body over {self.limit} bytes"), path)
        await response({"type": "http"}, _no_body, send)


class TraceContext:
    """The caller's W3C trace context headers, for the request's trace span
    (frontend/request_traces.py): set for the request's task, which submits it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1")
                       for k, v in scope.get("headers") or () if k in _TRACE_HEADERS}
            CALLER_TRACE.set(caller_headers(headers))
        await self.app(scope, receive, send)


_TRACE_HEADERS = (b"traceparent", b"tracestate")


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def error_response(exc: ApiError, path: str = "") -> JSONResponse:
    """The error in the shape of the API `path` belongs to: Anthropic's under /v1/messages,
    OpenAI's elsewhere."""
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error(exc), status_code=exc.status)
    return JSONResponse(exc.body(), status_code=exc.status)


def _param(loc: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not ("[" in part or part.lower() in _UNION_TAGS
                                            or "-" in part):
            out += f".{part}" if out else part
    return out


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body", None, "invalid_parameter")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg', '')}", None,
                        "invalid_json")
    param = _param(tuple(first.get("loc", ())))
    if kind == "extra_forbidden":
        message = f"{param}: unknown parameter; this server does not support it"
    elif kind == "missing" and not param:
        message = "the request needs a JSON body"
    elif not param:
        message = "the body must be a JSON object"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else \
            first.get("msg", "invalid request")
    return ApiError(400, message, param or None, "invalid_parameter")


def build_app(serving: Serving, metrics_registry: CollectorRegistry = REGISTRY,
              api_key: str = "", runtime_lora: bool = False,
              controls: EngineControls | None = None,
              pooling: PoolingServing | None = None) -> FastAPI:
    """The app; `api_key` (`--api-key`): the key the protected routes need
    (openai_api/auth.py); `runtime_lora`: the load / unload adapter routes (vLLM has them
    only when allowed); `controls`: serve the rollout controls too (openai_api/control.py);
    `pooling`: a --runner pooling server's embeddings, rerank and score (its generation
    routes answer 400 naming the runner, as a generation server's pooling routes do)."""
    frontend = serving.frontend
    models = serving.models
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, message), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                       None, "internal_error"), request.url.path)

    def max_model_len() -> int | None:
        return frontend.limits.max_model_len if frontend.limits is not None else None

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": await models.listed(max_model_len())}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        return models.card(models.resolve(model), max_model_len())

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await serving.create(request, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        return await serving.create(request, body)

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest) -> Response:
        return await respond(serving, request, body)

    # Anthropic's clients send `anthropic-version` (and `x-api-key`) headers: nothing here
    # depends on the version, so any is accepted.
    @app.post(ANTHROPIC_PREFIX)
    async def messages(request: Request, body: MessagesRequest) -> Response:
        return await create_message(serving, request, body)

    @app.post(ANTHROPIC_PREFIX + "/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(serving, body)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(serving, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, str]:
        return detokenize(serving, body)

    @app.get("/health")
    async def health() -> Response:
        if frontend.serving and frontend.accepting:
            return JSONResponse({"status": "ok"})
        why = "server is shutting down" if not frontend.accepting else "server is starting"
        return error_response(ApiError(503, why, None, "service_unavailable"))

    @app.get("/live")
    async def live() -> Response:
        engine = frontend.engine
        if not engine.ready.is_set():  # loading: the startup probe's time, not liveness's
            return JSONResponse({"status": "starting"})
        stalled = engine.liveness.stalled_for(engine.num_in_flight, time.monotonic())
        if stalled is None:
            return JSONResponse({"status": "ok"})
        why = (f"no engine plan has completed for {stalled:.1f} s with {engine.num_in_flight} "
               f"requests open (--liveness-timeout {engine.liveness.timeout:g})")
        if engine.liveness.first_word():  # why the orchestrator is about to restart us
            log.warning("not live: %s", why)
        return error_response(ApiError(503, why, None, "engine_stalled"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    # sglang-router (0.3) asks each worker for /server_info (/get_server_info before sglang
    # renamed it) when it registers it, and lists the model by its served_model_name: without
    # it the router's /v1/models says "unknown". vLLM has no such endpoint; this is sglang's
    # shape with the fields Tandem knows.
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        info: dict[str, Any] = {"served_model_name": models.base, "model_path": models.names[-1]}
        if max_model_len() is not None:
            info["context_length"] = max_model_len()
        return info

    if pooling is not None:
        add_pooling_routes(app, pooling)
    app.add_middleware(RunnerRoutes, pooling=pooling is not None)
    if runtime_lora:
        add_lora_routes(app, models)
    if controls is not None:
        from tandem_serve.openai_api.control import add_control_routes

        add_control_routes(app, controls)
    app.add_middleware(BodyLimit)
    app.add_middleware(TraceContext)
    if api_key:  # outermost: a request without the key is answered before its body is read
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    return app
