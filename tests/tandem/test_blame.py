"""Which child the launcher names when several exit: the cause, not the first one reaped."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from tandem_serve.proto.config import ServerConfig
from tandem_serve.tandem.launcher import Child, Launcher


@dataclass
class FakeProc:
    pid: int
    returncode: int


def blamed(exits: list[tuple[str, int, float]], consequences: tuple[str, ...] = ()) -> str:
    """The failure message after children (role, exit status, reaped at) have exited."""
    launcher = Launcher(ServerConfig(model="", standalone=True))
    loop = asyncio.new_event_loop()
    try:
        launcher._failure = loop.create_future()
        launcher.children = [Child(role, FakeProc(100 + i, rc), at)  # type: ignore[arg-type]
                             for i, (role, rc, at) in enumerate(exits)]
        launcher._consequences = set(consequences)
        launcher._blame()
        return launcher._failure.result()
    finally:
        loop.close()


def test_a_killed_child_is_the_cause_even_when_a_consequence_was_reaped_first() -> None:
    # Under load the postproc worker that left because the gpu worker died can be reaped
    # before the gpu worker itself.
    msg = blamed([("postproc 0", 1, 1.0), ("gpu-worker", -9, 1.2)])
    assert msg == "gpu-worker process (pid 101) was killed by SIGKILL"


def test_a_child_that_said_a_peer_ended_it_is_not_the_cause() -> None:
    msg = blamed([("gpu-worker", 1, 1.0), ("postproc 1", 1, 1.5)], consequences=("gpu-worker",))
    assert msg.startswith("postproc 1 process")


@pytest.mark.parametrize("exits, first", [
    ([("scheduler", 1, 2.0), ("postproc 0", 1, 1.0)], "postproc 0"),
    ([("scheduler", 0, 1.0), ("postproc 0", 3, 2.0)], "postproc 0"),  # crashed beats clean
    ([("scheduler", 0, 2.0), ("postproc 0", 0, 1.0)], "postproc 0"),
])
def test_otherwise_the_first_crash_then_the_first_exit(exits: list[tuple[str, int, float]],
                                                       first: str) -> None:
    assert blamed(exits).startswith(f"{first} process")
