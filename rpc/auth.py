"""`--api-key` on gRPC: every call but the health service's needs `authorization: Bearer KEY`
in its metadata, else UNAUTHENTICATED before the handler runs.

Health stays open because probes (the kubelet's gRPC probe among them) carry no key. The
generation service, the admin service (stats and profiles) and reflection are closed: the
key's holder can still list the services with `grpcurl -H 'authorization: Bearer KEY'`.
"""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health

OPEN_SERVICES = (f"/{health.SERVICE_NAME}/",)


def bearer_key(metadata: tuple[tuple[str, str | bytes], ...] | None) -> bytes | None:
    for name, value in metadata or ():
        if name == "authorization":
            raw = value.encode() if isinstance(value, str) else value
            scheme, _, token = raw.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call of a closed service without the server's key."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        presented = bearer_key(details.invocation_metadata)
        # compare_digest still runs for a missing key, so its absence is not timed apart.
        if hmac.compare_digest(presented or b"", self._key) and presented is not None:
            return handler
        return _refusal(handler, "missing or wrong API key: send metadata "
                                 "'authorization: Bearer <key>'")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that refuses (the request's bytes are never parsed)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raised

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse_stream if handler.response_streaming else refuse,
                response_serializer=handler.response_serializer)
