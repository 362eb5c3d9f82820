"""The pooling routes on the FastAPI app (`--runner pooling`):

    POST /v1/embeddings                  OpenAI's embeddings
    POST /v1/rerank, /rerank, /v2/rerank Jina's / Cohere's rerank, as vLLM serves it
    POST /score, /v1/score               vLLM's score: text_1 against text_2
"""
from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem_serve.openai_api.chat.serving import ClientGone, unless_disconnected
from tandem_serve.openai_api.errors import ApiError
from tandem_serve.openai_api.pooling.protocol import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from tandem_serve.openai_api.pooling.serving import PoolingServing

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


async def _answer(request: Request, work: Awaitable[dict[str, Any]]) -> Any:
    """The response, or 499 when the client went away first: its inputs still queued are
    aborted (`frontend.pooling.Pooler`), so nobody computes what nobody reads."""
    try:
        # Plain JSON types only: json.dumps directly, not FastAPI's walk over every float.
        return JSONResponse(await unless_disconnected(request, work))
    except ClientGone:
        return Response(status_code=499)


def add_pooling_routes(app: FastAPI, pooling: PoolingServing) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest) -> Any:
        return await _answer(request, pooling.embeddings(body))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request, body: RerankRequest) -> Any:
        return await _answer(request, pooling.rerank(body))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request, body: ScoreRequest) -> Any:
        return await _answer(request, pooling.score(body))


def pooling_only(path: str) -> ApiError:
    """What a generation route answers on a pooling server."""
    return ApiError(400, f"{path} generates text, and this server runs --runner pooling "
                         f"(embeddings, rerank and score: /v1/embeddings, /v1/rerank, /score)",
                    None, "wrong_runner")


def generation_only(path: str) -> ApiError:
    """What a pooling route answers on a generation server."""
    return ApiError(400, f"{path} needs a pooling model, and this server runs --runner "
                         f"generate; start it with --runner pooling and an embedding or "
                         f"cross-encoder model", None, "wrong_runner")


POOLING_ROUTES = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/score",
                  "/v1/score")


class RunnerRoutes:
    """400 naming the runner for a route the other runner serves, before its body is read
    (a body the route would refuse anyway still learns the real reason)."""

    def __init__(self, app: ASGIApp, pooling: bool) -> None:
        self.app = app
        self.refused = GENERATION_ROUTES if pooling else POOLING_ROUTES
        self.answer = pooling_only if pooling else generation_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.rstrip("/") in self.refused:
            exc = self.answer(path.rstrip("/"))
            response = JSONResponse(exc.body(), status_code=exc.status)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
