"""The frontend's gRPC server: its options, its port (TLS when asked), and its services.

`fmaas.GenerationService` and the read-only admin service, next to the standard health
check (service "" for liveness, "fmaas.GenerationService" for readiness, which the frontend
process turns on after warm-up: tandem/serve.py) and server reflection.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem_serve.frontend.frontend import Frontend
from tandem_serve.frontend.request_traces import CALLER_TRACE, caller_headers
from tandem_serve.ipc.process import StartupError
from tandem_serve.proto import generation_pb2 as pb
from tandem_serve.proto.config import ServerConfig
from tandem_serve.rpc.auth import ApiKeyInterceptor
from tandem_serve.rpc.server import ADMIN_SERVICE_NAME, GenerationServicer, add_admin_service
from tandem_serve.rpc.wire import add_generation_service

GRPC_OPTIONS = [
    # A port another server holds is an error, not a port shared with it.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Long streams stay up: answer client keepalive pings, send our own every 60 s.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def bound_grpc_server(cfg: ServerConfig) -> grpc.aio.Server:
    """A server listening on `--host:--port` (TLS and mutual TLS with the --tls-* flags;
    every service but health behind `--api-key`: rpc/auth.py)."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if cfg.api_key:
        interceptors.append(ApiKeyInterceptor(cfg.api_key))
    if cfg.otlp_traces_endpoint:
        interceptors.append(TraceContextInterceptor())
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors or None)
    target = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert:
        with open(cfg.tls_key, "rb") as f:
            key = f.read()
        with open(cfg.tls_cert, "rb") as f:
            cert = f.read()
        ca = None
        if cfg.tls_client_ca:
            with open(cfg.tls_client_ca, "rb") as f:
                ca = f.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                            require_client_auth=ca is not None)
        add_port = partial(server.add_secure_port, target, creds)
    else:
        add_port = partial(server.add_insecure_port, target)
    try:
        add_port()
    except RuntimeError as exc:  # the preflight check passed, so someone took it since
        raise StartupError(f"--port {cfg.port}: cannot listen on {target} ({exc})") from None
    return server


class TraceContextInterceptor(grpc.aio.ServerInterceptor):
    """The caller's W3C trace context (`traceparent` metadata) for the request's trace span
    (frontend/request_traces.py): grpc.aio runs the handler in the context the interceptor
    ran in (tests/e2e/test_operations_api.py sends one)."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        pairs = {k: v for k, v in details.invocation_metadata or ()
                 if isinstance(v, str)}
        CALLER_TRACE.set(caller_headers(pairs))
        return await continuation(details)


def add_services(server: grpc.aio.Server, frontend: Frontend) -> object:
    """Register every service; returns the health servicer tandem/serve.py drives."""
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else \
        health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["GenerationService"].full_name,
         ADMIN_SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    # Our own request deserializer: bytes that do not parse are INVALID_ARGUMENT, not grpc's
    # INTERNAL (rpc/wire.py).
    add_generation_service(GenerationServicer(frontend), server)
    add_admin_service(server, frontend.engine)
    return health_servicer


async def set_health(servicer: object, service: str, status: int) -> None:
    result = servicer.set(service, status)  # type: ignore[attr-defined]
    if asyncio.iscoroutine(result):
        await result
