"""The role runtime: dispatch by type, Shutdown, readiness, joining a set, faults, closing."""
from __future__ import annotations

import gc
import logging
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tandem_serve.ipc import channels, faults
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.peers import PeerLost
from tandem_serve.ipc.role_loop import Announce, Inbox, RoleLoop
from tandem_serve.proto.config import Addresses, ServerConfig
from tandem_serve.proto.control_messages import Ready, Shutdown
from tandem_serve.proto.monitor_messages import Heartbeat, ProfileControl, ProfileData
from tandem_serve.proto.plan_messages import StepPlan
from tandem_serve.proto.token_messages import StopHit

log = logging.getLogger("tandem.test_role")


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """A role freezes the heap it starts with (`ipc.process.freeze_heap`): here, pytest's.
    Thawed after each test, so what later tests leave in cycles is still collected."""
    yield
    gc.unfreeze()


class Script:
    """A source that hands over one batch per receive (a callable is called then, to build
    a message from what the role knows by that time), then a Shutdown."""

    def __init__(self, *batches: list[Any]) -> None:
        self.batches = list(batches)

    def receive(self) -> list[Any]:
        if not self.batches:
            return [Shutdown("end of script")]
        return [m() if callable(m) else m for m in self.batches.pop(0)]


class Closes:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def cfg(tmp_path: pathlib.Path) -> Iterator[ServerConfig]:
    yield ServerConfig(model="", addresses=Addresses.local(str(tmp_path), "t", 1, False))
    channels.set_epoch(0)


def role_loop(cfg: ServerConfig, **kw: Any) -> RoleLoop:
    return RoleLoop(cfg, "postproc", 0, log=log, inbox=Receiver(cfg.addresses.postproc_inboxes[0]),
                    **kw)


def test_messages_go_to_their_handlers_in_order_until_shutdown(
        cfg: ServerConfig, caplog: pytest.LogCaptureFixture) -> None:
    got: list[object] = []
    passed_on: list[Shutdown] = []
    plan, stop = StepPlan(7, 1), StopHit(3, 4)
    with caplog.at_level(logging.INFO, log.name), role_loop(cfg) as role:
        role.run({StepPlan: got.append, StopHit: got.append}, on_shutdown=passed_on.append,
                 source=Script([plan, Ready("x", 0), stop], [Shutdown("bye"), plan]))
    assert got == [plan, stop]  # nothing after the Shutdown
    assert [s.reason for s in passed_on] == ["bye"]
    assert "unexpected message Ready" in caplog.text
    assert "shutting down: bye" in caplog.text


def test_idle_runs_after_an_empty_wait_and_work_after_every_receive(cfg: ServerConfig) -> None:
    calls: list[str] = []
    with role_loop(cfg) as role:
        role.run({StepPlan: lambda m: calls.append("plan")}, source=Script([], [StepPlan(0, 1)]),
                 idle=lambda: calls.append("idle"), work=lambda: calls.append("work"))
    assert calls == ["idle", "work", "plan", "work"]


def test_the_inbox_source_drains_what_waits_behind_the_first(cfg: ServerConfig) -> None:
    addr = cfg.addresses.postproc_inboxes[0]
    rx: Receiver = Receiver(addr)
    tx: Sender = Sender(addr)
    try:
        for i in range(3):
            tx.put(StopHit(i, 1))
        # A drain takes what has arrived: let ZeroMQ's I/O threads deliver all three (on a
        # loaded machine the first can arrive well before the others).
        time.sleep(1.0)
        assert [m.request_id for m in Inbox(rx, 5.0, drain=True).receive()] == [0, 1, 2]
        tx.put(StopHit(3, 1))
        tx.put(StopHit(4, 1))
        one = Inbox(rx, 5.0)
        assert [m.request_id for m in one.receive()] == [3]
        assert [m.request_id for m in one.receive()] == [4]
        assert Inbox(rx, 0.01).receive() == []
    finally:
        tx.close()
        rx.close()


def test_under_the_launcher_a_role_is_ready_at_once(cfg: ServerConfig) -> None:
    replies: Receiver = Receiver(cfg.addresses.frontend_inbox)
    try:
        with role_loop(cfg, reply=Sender(cfg.addresses.frontend_inbox)) as role:
            assert role.reply is not None
            gc.unfreeze()
            role.run({}, ready=Announce(role.reply, Ready("postproc", 0), "worker 0 of 1"),
                     source=Script())
            assert role.peers is None
            # Start-up's objects were frozen before serving: a full collection skips them.
            assert gc.get_freeze_count() > 1000
        assert replies.get(timeout=5.0) == Ready("postproc", 0)
    finally:
        replies.close()


def test_on_its_own_a_role_joins_when_listed_and_leaves_when_replaced(
        cfg: ServerConfig, caplog: pytest.LogCaptureFixture) -> None:
    cfg = ServerConfig(model="", standalone=True, addresses=cfg.addresses)
    to: Receiver = Receiver(cfg.addresses.scheduler_inbox)
    role = role_loop(cfg)

    def listed(epoch: int) -> Callable[[], Heartbeat]:
        """The frontend's heartbeat for set `epoch`, listing us (known once we run)."""
        return lambda: Heartbeat("frontend", 0, 5, epoch, [role.peers.incarnation]
                                 if role.peers is not None else [])

    try:
        with caplog.at_level(logging.INFO, log.name), pytest.raises(PeerLost), role:
            ready = Announce(Sender(cfg.addresses.scheduler_inbox), Ready("postproc", 0),
                             "worker 0 of 1", repeat=True)
            role.own(ready.to)
            role.run({}, ready=ready, source=Script(
                [Heartbeat("frontend", 0, 5, 9, [])],  # not admitted yet
                [listed(9)], [listed(9)],  # joins, then says it again
                [Heartbeat("frontend", 0, 5, 10, [])]))  # a new set without us: leave
        assert to.get(timeout=5.0) == Ready("postproc", 0)
        assert to.get(timeout=5.0) == Ready("postproc", 0)
        assert to.get(timeout=0.2) is None
        assert "ready (worker 0 of 1), in the set of epoch 9" in caplog.text
        assert channels.current_epoch() == 9
    finally:
        to.close()


def test_profile_control_records_and_replies(cfg: ServerConfig) -> None:
    replies: Receiver = Receiver(cfg.addresses.frontend_inbox)
    try:
        with role_loop(cfg, reply=Sender(cfg.addresses.frontend_inbox)) as role:
            role.run({}, source=Script([ProfileControl(start=True)], [ProfileControl(start=False)]))
        data = replies.get(timeout=5.0)
        assert isinstance(data, ProfileData) and data.role == "postproc 0"
    finally:
        replies.close()


def test_faults_fire_under_the_process_title(cfg: ServerConfig) -> None:
    faults.configure("gpu-worker 0/2:plan=3:raise")
    try:
        with RoleLoop(cfg, "gpu-worker", title="gpu-worker 0/2", log=log,
                      inbox=Receiver(cfg.addresses.worker_inbox)) as role:
            role.maybe_fault(2)
            with pytest.raises(faults.InjectedFault):
                role.maybe_fault(3)
    finally:
        faults.configure("")


def test_everything_owned_is_closed_and_a_context_sees_how_the_role_ended(
        cfg: ServerConfig) -> None:
    owned = Closes()
    seen: list[type[BaseException] | None] = []

    @contextmanager
    def watching() -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            seen.append(type(exc))
            raise

    inbox = cfg.addresses.postproc_inboxes[0][len("ipc://"):]
    with pytest.raises(SystemExit), role_loop(cfg) as role:
        role.own(owned)
        role.enter(watching())
        assert os.path.exists(inbox)
        raise SystemExit(143)  # what SIGTERM becomes in a child
    assert owned.closed and seen == [SystemExit]
    assert not os.path.exists(inbox)
