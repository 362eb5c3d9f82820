"""`--api-key`: the HTTP routes that need `Authorization: Bearer KEY`, and the check.

Every `/v1/*` route is protected, and so is every control endpoint in CONTROL_PATHS, whether
or not this server has it yet: a route added later is covered the moment it exists. Health,
readiness, liveness and metrics stay open (probes and scrapers carry no key; vLLM does the
same). Anthropic's clients send the key as `x-api-key`, so `/v1/messages*` takes either
header and answers in Anthropic's error shape.

The comparison is `hmac.compare_digest` over bytes: its time does not depend on how much of
the key a guess got right.
"""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem_serve.openai_api.errors import ApiError

# Not under /v1 but no less powerful: tokenizer, scoring and the engine's control switches.
CONTROL_PATHS = frozenset({
    "/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/sleep", "/wake_up",
    "/is_sleeping", "/pause", "/resume", "/reset_prefix_cache", "/load_weights",
})
ANTHROPIC_PREFIX = "/v1/messages"


def protected(path: str) -> bool:
    return path.startswith("/v1/") or path.rstrip("/") in CONTROL_PATHS


def presented_key(headers: dict[bytes, bytes], anthropic: bool) -> bytes | None:
    """The key the request carries: a Bearer token, or (Anthropic's routes) x-api-key."""
    auth = headers.get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    if anthropic and headers.get(b"x-api-key"):
        return headers[b"x-api-key"].strip()
    return None


def key_matches(presented: bytes | None, key: bytes) -> bool:
    # compare_digest still runs for a missing key, so its absence is not timed apart.
    return hmac.compare_digest(presented or b"", key) and presented is not None


class ApiKeyGuard:
    """401 for a protected route without the right key; everything else passes through."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        anthropic = scope["path"].startswith(ANTHROPIC_PREFIX)
        headers = dict(scope.get("headers") or ())
        if key_matches(presented_key(headers, anthropic), self.key):
            await self.app(scope, receive, send)
            return
        await unauthorized(anthropic)(scope, receive, send)


def unauthorized(anthropic: bool) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"}
    if anthropic:  # Anthropic's error shape, which its SDK turns into AuthenticationError
        body = {"type": "error", "error": {"type": "authentication_error",
                                           "message": "invalid x-api-key"}}
        return JSONResponse(body, status_code=401, headers=headers)
    exc = ApiError(401, "invalid API key: send it as 'Authorization: Bearer <key>'", None,
                   "invalid_api_key")
    return JSONResponse(exc.body(), status_code=401, headers=headers)
