"""Sets of roles started on their own: admission, joining, replacing a broken set."""
from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest

from tandem_serve.ipc import channels
from tandem_serve.ipc.peers import PeerLost, RoleWatch, SetWatch
from tandem_serve.proto.monitor_messages import Heartbeat

EXPECTED = ["scheduler", "gpu-worker", "postproc 0"]
ROLES = [("scheduler", 0), ("gpu-worker", 0), ("postproc", 0)]


@pytest.fixture
def net(tmp_path: pathlib.Path) -> Iterator[str]:
    yield f"ipc://{tmp_path}/nobody"  # heartbeats go nowhere: the tests hand them over
    channels.set_epoch(0)


def role_heartbeat(w: RoleWatch) -> Heartbeat:
    return w.beacon.me


def exchange(front: SetWatch, roles: list[RoleWatch]) -> list[bool]:
    """One round of heartbeats both ways; which roles joined the set in it."""
    for r in roles:
        front.seen(role_heartbeat(r))
    return [r.seen(front.beacon.me) for r in roles]


def test_fresh_roles_are_admitted_and_join_the_frontends_set(net: str) -> None:
    front = SetWatch([net], EXPECTED)
    roles = [RoleWatch(role, i, net) for role, i in ROLES]
    try:
        epoch = front.epoch
        assert channels.current_epoch() == epoch  # the frontend stamps with its set's epoch
        assert exchange(front, roles) == [True, True, True]
        assert {r.epoch for r in roles} == {epoch}
        assert front.missing() == []
        assert exchange(front, roles) == [False, False, False]  # joined once
        assert all(m.joined for m in front.members.values())
        assert front.lost() == ""
    finally:
        front.close()
        for r in roles:
            r.close()


def test_a_restarted_member_breaks_the_set_and_every_old_member_leaves(net: str) -> None:
    front = SetWatch([net], EXPECTED)
    roles = [RoleWatch(role, i, net) for role, i in ROLES]
    restarted = RoleWatch("scheduler", 0, net)  # same name, new process: faster than any timeout
    try:
        exchange(front, roles)
        exchange(front, roles)
        front.seen(role_heartbeat(restarted))
        assert front.lost() == "scheduler restarted"
        old_epoch = front.epoch
        front.renew()
        assert front.epoch != old_epoch and front.lost() == ""
        # The restarted scheduler carries over into the new set; the old processes do not.
        assert list(front.members) == ["scheduler"]
        assert restarted.seen(front.beacon.me)
        for r in roles[1:]:
            with pytest.raises(PeerLost, match="replaced the set"):
                r.seen(front.beacon.me)
            front.seen(role_heartbeat(r))  # retired: never admitted again
        assert front.missing() == ["gpu-worker", "postproc 0"]
        replacements = [RoleWatch(role, i, net) for role, i in ROLES[1:]]
        assert exchange(front, replacements) == [True, True]
        assert front.missing() == []
        for r in replacements:
            r.close()
    finally:
        front.close()
        restarted.close()
        for r in roles:
            r.close()


def test_a_silent_member_is_lost_and_a_silent_frontend_too(net: str) -> None:
    front = SetWatch([net], EXPECTED, timeout=0.2)
    roles = [RoleWatch(role, i, net, timeout=0.2) for role, i in ROLES]
    try:
        exchange(front, roles)
        time.sleep(0.3)
        front.seen(role_heartbeat(roles[0]))
        front.seen(role_heartbeat(roles[2]))
        assert front.lost().startswith("gpu-worker stopped sending heartbeats")
        with pytest.raises(PeerLost, match="frontend stopped sending heartbeats"):
            roles[0].check()
    finally:
        front.close()
        for r in roles:
            r.close()


def test_a_new_frontend_makes_the_roles_of_the_old_one_leave(net: str) -> None:
    old = SetWatch([net], EXPECTED)
    roles = [RoleWatch(role, i, net) for role, i in ROLES]
    try:
        exchange(old, roles)
        new = SetWatch([net], EXPECTED)
        for r in roles:
            new.seen(role_heartbeat(r))  # they serve another set: not admitted
            with pytest.raises(PeerLost, match="a new frontend took over"):
                r.seen(new.beacon.me)
        assert new.missing() == EXPECTED
        new.close()
    finally:
        old.close()
        for r in roles:
            r.close()


def test_silence_counts_only_up_to_when_the_inbox_was_last_read_to_its_end(net: str) -> None:
    """A process busy for longer than the timeout (a long plan, a starved event loop) reads
    the heartbeats that queued meanwhile late; it must not take that for a death."""
    front = SetWatch([net], EXPECTED, timeout=0.2)
    role = RoleWatch("scheduler", 0, net, timeout=0.2)
    try:
        front.seen(role_heartbeat(role))
        role.seen(front.beacon.me)
        drained = time.monotonic()  # both inboxes were empty now...
        time.sleep(0.3)  # ...then both sides were busy, with heartbeats waiting
        role.check(drained_at=drained)
        assert front.lost(drained_at=drained) == ""
        with pytest.raises(PeerLost):  # read to the end, and nothing came: that is silence
            role.check(drained_at=time.monotonic())
        assert front.lost(drained_at=time.monotonic()).startswith("scheduler stopped")
    finally:
        front.close()
        role.close()
