"""SIGTERM over real processes (DESIGN.md section 5): readiness off at once, no new requests,
in-flight ones finish (up to --shutdown-timeout, then they are cancelled with a reason),
exit 0; a second signal exits at once.  Nothing of the tree is left either way."""
from __future__ import annotations

import pathlib
import signal
import time

import grpc
import pytest

from tests.e2e.server import Server, Stream

pytestmark = pytest.mark.slow

FLAGS = ("--num-scheduler-steps", "2")


def wait_not_serving(server: Server, timeout: float = 1.0) -> float:
    """Seconds until health says NOT_SERVING (fails after `timeout`)."""
    start = time.monotonic()
    while server.client.is_serving(timeout=0.5):
        assert time.monotonic() - start < timeout, "still SERVING after SIGTERM"
        time.sleep(0.02)
    return time.monotonic() - start


def assert_rejected(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(server.client.stream("a new request", Stream.options(4), timeout=5))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "shutting down" in (err.value.details() or "")


def test_sigterm_drains_in_flight_streams_and_exits_0(tiny_model_dir: pathlib.Path) -> None:
    n = 150
    server = Server(str(tiny_model_dir), *FLAGS).wait_ready()
    try:
        streams = [Stream(server, f"Drain test stream {i}:", n) for i in range(8)]
        for s in streams:
            assert s.first_token.wait(60)
        in_flight = [s.tokens for s in streams]
        server.proc.send_signal(signal.SIGTERM)
        wait_not_serving(server)
        assert_rejected(server)
        assert all(0 < t < n for t in in_flight), in_flight
        for s in streams:
            assert s.join(60)
            assert s.code is None, (s.code, s.details)
            assert (s.tokens, s.stop_reason) == (n, 1)  # MAX_TOKENS: complete, not cut
        assert server.proc.wait(30) == 0
    finally:
        server.stop(signal.SIGKILL)
    assert server.leftovers() == []


def test_shutdown_timeout_cancels_what_is_left(tiny_model_dir: pathlib.Path) -> None:
    server = Server(str(tiny_model_dir), *FLAGS, "--shutdown-timeout", "1").wait_ready()
    try:
        streams = [Stream(server, f"Deadline test stream {i}:", 1000) for i in range(2)]
        for s in streams:
            assert s.first_token.wait(60)
        signalled = time.time()
        server.proc.send_signal(signal.SIGTERM)
        for s in streams:
            assert s.join(10)
            assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
            assert "shutdown timeout" in s.details
            assert s.ended_at - signalled < 1.0 + 2.0
        assert server.proc.wait(30) == 0
    finally:
        server.stop(signal.SIGKILL)
    assert server.leftovers() == []


def test_second_signal_exits_at_once(tiny_model_dir: pathlib.Path) -> None:
    server = Server(str(tiny_model_dir), *FLAGS).wait_ready()
    try:
        streams = [Stream(server, f"Second signal stream {i}:", 1000) for i in range(2)]
        for s in streams:
            assert s.first_token.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        wait_not_serving(server)
        second = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        rc = server.proc.wait(10)
        assert time.monotonic() - second < 3.0
        assert rc != 0
        for s in streams:
            assert s.join(10) and s.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(signal.SIGKILL)
    assert server.leftovers() == []
