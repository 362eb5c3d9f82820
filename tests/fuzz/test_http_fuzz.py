"""Fuzzing the OpenAI-compatible HTTP API (`openai_api/`, served with `--http-port`).

Random JSON bodies for /v1/completions, /v1/chat/completions (`strategies.openai_body`) and
/v1/responses (`strategies.responses_body`): well-formed requests with random values (tools
and tool choices among them), any JSON value in any field, non-objects, and bodies that are
not JSON at all.  Every answer is 200 or a 400 with an OpenAI-shaped error (404 only for a
model name the server does not serve); never a 5xx, a 422 or a dropped connection; a 200
stream ends with `data: [DONE]` (a response stream with `response.completed`).  Afterwards
/health is 200, every KV block is free and greedy output still equals HF.

The size and seed knobs are the gRPC fuzz's (`TANDEM_FUZZ_EXAMPLES`, `TANDEM_FUZZ_SEED`).
"""
from __future__ import annotations

import http.client
import json
import pathlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, running
from tests.fuzz.strategies import OPENAI_ROUTES
from tests.fuzz.test_grpc_fuzz import FLAGS, FUZZ, SEED
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

TIMEOUT = 120.0
NOT_JSON = [b"", b"{", b"[1, 2", b"\xff\xfe", b'{"model": "x", "prompt": "\xff"}', b"null",
            b'{"prompt": "a"' + b" " * 100_000]
OUTCOMES: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def server(fast_model_dir: pathlib.Path) -> Iterator[Server]:
    yield from running(str(fast_model_dir), *FLAGS, http=True)


def http_port(server: Server) -> int:
    return server.http_port


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", http_port(server), timeout=TIMEOUT)
    conn.request("GET", "/v1/models")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return str(data["data"][0]["id"])


def check_error(status: int, raw: bytes, what: str) -> None:
    body = json.loads(raw)
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{status} {what}"
    assert body["error"].get("message"), f"an error without a message: {raw[:300]!r}"


def check_success(path: str, raw: bytes, body: Any) -> None:
    stream = isinstance(body, dict) and body.get("stream") is True
    if path == "/v1/responses":  # OpenAI's events, ending with the response (or an error)
        if stream:
            last = raw.rstrip().rsplit(b"\n\n", 1)[-1]
            assert last.startswith((b"event: response.completed", b"event: error")), raw[-300:]
        else:
            assert json.loads(raw)["object"] == "response"
    elif stream:
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    else:
        assert "choices" in json.loads(raw)


@FUZZ
@seed(SEED)
@given(data=st.data())
def test_every_body_is_answered_200_or_400(server: Server, model: str,
                                           data: st.DataObject) -> None:
    path, strategy = data.draw(st.sampled_from(OPENAI_ROUTES))
    if data.draw(st.integers(0, 9)) == 0:
        body: Any = None
        raw_in = data.draw(st.sampled_from(NOT_JSON))
    else:
        body = data.draw(strategy(model))
        raw_in = json.dumps(body).encode()
    status, raw = post(http_port(server), path, raw_in)
    OUTCOMES[(path, status)] += 1
    what = f"{path} {raw_in[:1000]!r} -> {raw[:500]!r}"
    wrong_model = isinstance(body, dict) and body.get("model") not in (None, model)
    assert status in (200, 400) or (status == 404 and wrong_model), f"{status}: {what}"
    if status == 200:
        check_success(path, raw, body)
    else:
        check_error(status, raw, what)


def test_after_http_fuzzing_the_server_is_healthy_idle_and_still_equal_to_hf(
        server: Server, fast_model_dir: pathlib.Path) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", http_port(server), timeout=TIMEOUT)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    deadline = time.monotonic() + 20
    while True:
        stats = server.client.stats()
        idle = (stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
                and stats.num_waiting == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, f"not idle after fuzzing: {stats}"
    prompt, n = "Once upon a time", 16
    got = "".join(r.text for r in server.client.stream(
        prompt, GenerateOptions(max_new_tokens=n, min_new_tokens=n)))
    assert got == hf_greedy(fast_model_dir, [(prompt, n)])[0]
    print("\nHTTP fuzz outcomes:", dict(OUTCOMES))
