"""The failure contract over real processes (DESIGN.md section 5).

A child that dies (SIGKILL, an exception, a hang past --step-timeout) fails every open
stream with UNAVAILABLE naming it within 2 s, the server exits non-zero within 5 s, and
nothing of the tree is left: no process, shm segment, socket file or run folder.  A
launcher killed by SIGKILL takes its children, run folder and segments with it.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from tandem_serve.guided.worker import TITLE
from tandem_serve.rpc.client import GenerateOptions
from tests.e2e.server import Server, Stream, alive, cmdline, tree_pids

pytestmark = pytest.mark.slow

FLAGS = ("--num-scheduler-steps", "2")
NUM_STREAMS = 4
LONG = 1000  # tokens: no stream can finish on its own while a test runs
# The warm-up takes the first few plans; by this one every test stream is running.
FAULT_PLAN = 20
FAIL_WITHIN = 2.0
EXIT_WITHIN = 5.0


def open_streams(server: Server, n: int = NUM_STREAMS) -> list[Stream]:
    streams = [Stream(server, f"Stream {i} of a failure test:", LONG) for i in range(n)]
    for s in streams:
        assert s.first_token.wait(60), "no token within 60 s"
    return streams


def fault_time(log: str) -> float:
    """When the injected fault fired (wall clock), from the line `ipc.faults` logs."""
    match = re.search(r"fault injected: .* \(wall ([0-9.]+)\)", log)
    assert match, f"no fault line in the log:\n{log[-3000:]}"
    return float(match.group(1))


def wait_exit(server: Server, timeout: float = 30.0) -> tuple[int, float]:
    """The server's exit code and wall-clock exit time."""
    rc = server.proc.wait(timeout)
    return rc, time.time()


def assert_failed(streams: list[Stream], since: float, *words: str) -> None:
    for s in streams:
        assert s.join(10), "stream still open 10 s after the failure"
        assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details, s.tokens)
        for w in words:
            assert w in s.details, s.details
        assert s.ended_at - since < FAIL_WITHIN, f"stream ended {s.ended_at - since:.2f} s late"


def assert_clean(server: Server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while server.leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.leftovers() == []


@pytest.mark.parametrize("role, how", [
    ("scheduler", "sigkill"), ("gpu-worker", "sigkill"), ("postproc 0", "sigkill"),
    ("scheduler", "raise"), ("gpu-worker", "raise"), ("postproc 0", "raise"),
])
def test_child_death_fails_streams_and_server_exits(tiny_model_dir: pathlib.Path, role: str,
                                                    how: str) -> None:
    env = {"TANDEM_FAULT": f"{role}:plan={FAULT_PLAN}:raise"} if how == "raise" else None
    server = Server(str(tiny_model_dir), *FLAGS, env=env).wait_ready()
    try:
        pid = server.role_pids()[role]
        streams = open_streams(server)
        late = None
        if how == "sigkill":
            died = time.time()
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
            # Arrives after the death, before the exit: UNAVAILABLE, not a hang.
            late = Stream(server, "A request after the death", 4)
        rc, exited = wait_exit(server)
        log = server.log()
        if how == "raise":
            died = fault_time(log)
        cause = "killed by SIGKILL" if how == "sigkill" else "failed: InjectedFault"
        assert_failed(streams, died, role, cause, "shutting down")
        if late is not None:
            assert late.join(5) and late.code == grpc.StatusCode.UNAVAILABLE, late.details
        assert rc != 0
        assert exited - died < EXIT_WITHIN, f"exit {exited - died:.2f} s after the death"
    finally:
        server.stop(signal.SIGKILL)
    assert_clean(server)


def _ignore_rpc_error(call: Callable[[], object]) -> None:
    try:
        call()
    except grpc.RpcError:
        pass


def wait_for_compile_worker(server: Server, timeout: float = 30.0) -> bool:
    """Until the worker has started (it takes this title once it is ready to compile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(cmdline(p)[:1] == [TITLE] for p in tree_pids(server.proc.pid)):
            return True
        time.sleep(0.1)
    return False


def test_launcher_sigkill_takes_children_run_dir_and_shm(tiny_model_dir: pathlib.Path) -> None:
    server = Server(str(tiny_model_dir), *FLAGS).wait_ready()
    try:
        assert server.role_pids().keys() >= {"scheduler", "gpu-worker", "postproc 0"}
        streams = open_streams(server, 2)
        # The guided compile worker, caught in a compile of many seconds (any JSON object).
        compiling = threading.Thread(target=lambda: _ignore_rpc_error(
            lambda: server.client.generate(["x"], GenerateOptions(response_format="json"))),
            daemon=True)
        compiling.start()
        assert wait_for_compile_worker(server), "no compile worker within 30 s"
        time.sleep(0.5)
        server.note_children()
        server.proc.kill()
        server.proc.wait()
        deadline = time.monotonic() + EXIT_WITHIN
        while any(alive(p) for p in server.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in server.children if alive(p)] == []
        assert_clean(server)  # run folder (sockets), shm segment and compile worker too
        for s in streams:
            assert s.join(10) and s.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(signal.SIGKILL)


def hung_and_stopped(server: Server, step_timeout: float) -> str:
    """A server whose gpu worker hangs at FAULT_PLAN: its streams fail as hung after
    `step_timeout` and it exits non-zero soon after; the log."""
    streams = open_streams(server)
    rc, exited = wait_exit(server)
    log = server.log()
    hung = fault_time(log)
    # Seen after step_timeout (plus the scheduler's 0.2 s tick and the stack dumps).
    assert_failed(streams, hung + step_timeout, "gpu-worker", "hung", "step timeout")
    assert rc != 0
    assert exited - hung < step_timeout + EXIT_WITHIN
    return log


def test_hung_worker_is_dumped_and_treated_as_dead(tiny_model_dir: pathlib.Path) -> None:
    step_timeout = 3.0
    server = Server(str(tiny_model_dir), *FLAGS, "--step-timeout", str(step_timeout),
                    env={"TANDEM_FAULT": f"gpu-worker:plan={FAULT_PLAN}:hang"}).wait_ready()
    try:
        log = hung_and_stopped(server, step_timeout)
        # faulthandler's dump of the stuck process: thread headers and the hanging frame.
        assert "most recent call first" in log
        assert re.search(r'File ".*ipc/faults\.py", line \d+ in _fire', log), log[-3000:]
    finally:
        server.stop(signal.SIGKILL)
    assert_clean(server)
