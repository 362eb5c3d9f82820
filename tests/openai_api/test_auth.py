"""`--api-key` on HTTP (openai_api/auth.py) and gRPC (rpc/auth.py), each over a small app:
which routes and services are closed, both error shapes, both header spellings."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tandem_serve.openai_api.auth import CONTROL_PATHS, ApiKeyGuard, protected
from tandem_serve.proto import admin_pb2, admin_pb2_grpc
from tandem_serve.rpc.auth import ApiKeyInterceptor
from tandem_serve.rpc.client import make_channel

KEY = "s3cret-key"
OPEN = ["/health", "/live", "/metrics", "/server_info", "/v1", "/tokenizer_config"]


def _ok(request: object) -> PlainTextResponse:
    return PlainTextResponse("ok")


PATHS = ["/v1/models", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
         *sorted(CONTROL_PATHS), *OPEN]
APP = ApiKeyGuard(Starlette(routes=[Route(p, _ok, methods=["GET", "POST"]) for p in PATHS]),
                  KEY)


def get(path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APP),
                                     base_url="http://t") as c:
            return await c.post(path, headers=headers or {})
    return asyncio.run(go())


def test_the_protected_paths() -> None:
    assert protected("/v1/models") and protected("/v1/messages/count_tokens")
    assert protected("/tokenize") and protected("/tokenize/") and protected("/load_weights")
    for path in OPEN:
        assert not protected(path), path


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", *sorted(CONTROL_PATHS)])
def test_openai_routes_need_the_bearer_key(path: str) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                    {"x-api-key": KEY}, {"authorization": f"Basic {KEY}"}):
        r = get(path, headers)
        assert r.status_code == 401, (path, headers)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    r = get(path, {"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.text == "ok"
    assert get(path, {"Authorization": f"bearer  {KEY}"}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_routes_take_x_api_key_and_answer_in_its_shape(path: str) -> None:
    r = get(path, {"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "invalid x-api-key"}}
    assert get(path, {"x-api-key": KEY}).status_code == 200
    assert get(path, {"authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("path", OPEN)
def test_probes_and_metrics_stay_open(path: str) -> None:
    assert get(path).status_code == 200


# ---------------------------------------------------------------- gRPC


class _Admin(admin_pb2_grpc.AdminServicer):
    async def Stats(self, request: admin_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.StatsResponse:
        return admin_pb2.StatsResponse(num_running=7)


@pytest.fixture(scope="module")
def grpc_target() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    server: grpc.aio.Server

    async def start() -> int:
        nonlocal server
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(KEY)])
        admin_pb2_grpc.add_AdminServicer_to_server(_Admin(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port

    port = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_grpc_needs_the_key_but_for_health(grpc_target: str) -> None:
    for api_key in ("", "wrong"):
        channel = make_channel(grpc_target, api_key=api_key)
        with pytest.raises(grpc.RpcError) as e:
            admin_pb2_grpc.AdminStub(channel).Stats(admin_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in e.value.details()
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
    channel = make_channel(grpc_target, api_key=KEY)
    assert admin_pb2_grpc.AdminStub(channel).Stats(admin_pb2.StatsRequest(),
                                                   timeout=5).num_running == 7
    channel.close()
