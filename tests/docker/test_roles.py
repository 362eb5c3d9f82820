"""The compose deployment's roles as separate processes, started exactly as the compose file
says (its commands and environment), with 127.0.0.1 in place of the service names, and
compose's `restart: unless-stopped` played by `tandem_serve.harness.roles.RoleSet.restart_policy`.

A killed role is replaced with its whole set (every other backend role exits non-zero and is
restarted fresh) while the frontend keeps running: NOT_SERVING, then SERVING, with greedy
output equal to HF's before and after.  The scheduler comes back faster than the heartbeat
timeout, which only the processes' incarnations can tell from no restart at all; so does the
gpu worker, which joins the new set before the old scheduler has left.  A killed frontend
makes every role exit non-zero, and the restarted set serves again.
"""
from __future__ import annotations

import pathlib
import re
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from tandem_serve.harness.roles import ROLES, RoleSet, wait_health, wait_serving_anew
from tandem_serve.rpc.client import GenerateOptions, TandemClient
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [("Once upon a time", 12), ("The quick brown fox", 7)]
CLOCK = r"[0-9]{2}:[0-9]{2}"
BACKENDS = [r for r in ROLES if r != "frontend"]


@pytest.fixture(scope="module")
def hf_texts(fast_model_dir: pathlib.Path) -> list[str]:
    return hf_greedy(fast_model_dir, PROMPTS)


@pytest.fixture
def roles(fast_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[RoleSet]:
    rs = RoleSet(str(fast_model_dir), str(tmp_path), env={"TANDEM_LOG_LEVEL": "INFO"})
    rs.start_all()
    rs.restart_policy()
    try:
        yield rs
    finally:
        rs.stop()


def assert_outputs(client: TandemClient, want: list[str]) -> None:
    for (text, n), expected in zip(PROMPTS, want, strict=True):
        got = "".join(r.text for r in client.stream(
            text, GenerateOptions(max_new_tokens=n, min_new_tokens=n), timeout=60))
        assert got == expected


def guided_text(client: TandemClient) -> str:
    """A guided request's output.  Its request carries only the constraint's id, and the
    table goes to each new set of roles once (what the frontend sent does not outlive the
    set), so it decodes in every set as in the first."""
    got = "".join(r.text for r in client.stream(
        PROMPTS[0][0], GenerateOptions(max_new_tokens=20, regex=CLOCK), timeout=60))
    assert re.fullmatch(CLOCK, got), got
    return got


def long_stream(client: TandemClient) -> dict[str, object]:
    """A stream in flight on its own thread; the dict gets its status once it ends."""
    out: dict[str, object] = {}
    started = threading.Event()

    def run() -> None:
        try:
            for msg in client.stream("A long story:", GenerateOptions(max_new_tokens=1000,
                                                                     min_new_tokens=1000)):
                if msg.generated_token_count:
                    started.set()
            out["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            out["code"], out["details"] = exc.code(), exc.details()
        started.set()

    out["thread"] = t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60)
    return out


def test_killed_roles_are_replaced_and_the_set_serves_again(roles: RoleSet,
                                                            hf_texts: list[str]) -> None:
    client = TandemClient(roles.target)
    try:
        frontend = roles.procs["frontend"]
        wait_health(client, True, 180, frontend)
        assert_outputs(client, hf_texts)
        clock = guided_text(client)

        # The scheduler dies and compose starts it again at once.
        in_flight = long_stream(client)
        t0 = time.monotonic()
        roles.kill("scheduler")
        wait_health(client, False, 20, frontend)
        wait_health(client, True, 180, frontend)
        assert roles.procs["frontend"] is frontend and frontend.poll() is None
        in_flight["thread"].join(10)  # type: ignore[attr-defined]
        assert in_flight["code"] == grpc.StatusCode.UNAVAILABLE, in_flight
        assert "scheduler" in str(in_flight["details"])
        exits = roles.exits_since(t0)
        assert {e.role for e in exits} == set(BACKENDS), exits  # the whole set, not the frontend
        assert all(e.code != 0 for e in exits), exits
        assert_outputs(client, hf_texts)
        assert guided_text(client) == clock

        # The gpu worker dies and comes back (its WorkerReady must reach the scheduler of the
        # new set, not the one it replaces).
        t2 = time.monotonic()
        roles.kill("gpu-worker")
        wait_health(client, False, 20, frontend)
        wait_health(client, True, 180, frontend)
        assert {e.role for e in roles.exits_since(t2)} == set(BACKENDS)
        assert_outputs(client, hf_texts)
        assert guided_text(client) == clock

        # The frontend dies: every role leaves its set, and the restarted set serves.
        t1 = time.monotonic()
        roles.kill("frontend")
        deadline = time.monotonic() + 30
        while roles.procs["frontend"] is frontend:
            assert time.monotonic() < deadline, "the frontend was not restarted"
            time.sleep(0.05)
        wait_serving_anew(roles.target, 180)
        exits = roles.exits_since(t1)
        assert {e.role for e in exits} == set(ROLES), exits
        assert all(e.code != 0 for e in exits), exits
        assert_outputs(client, hf_texts)
        assert guided_text(client) == clock
    finally:
        client.close()
