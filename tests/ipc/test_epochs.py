"""Epoch stamps on every channel message: a set of roles never hears a set it replaced."""
from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest

from tandem_serve.ipc import channels
from tandem_serve.ipc.channels import Receiver, Sender, set_epoch
from tandem_serve.proto.monitor_messages import Heartbeat
from tandem_serve.proto.request_messages import AbortRequest

_senders: list[Sender] = []


@pytest.fixture
def addr(tmp_path: pathlib.Path) -> Iterator[str]:
    yield f"ipc://{tmp_path}/inbox"
    set_epoch(0)  # the process-wide epoch: leave it as every other test expects
    for s in _senders:  # only now: closing at once could drop what they queued (linger 0)
        s.close()
    _senders.clear()


def send(addr: str, epoch: int, *msgs: object) -> None:
    """Messages from a process of set `epoch` (stamped with it)."""
    mine = channels.current_epoch()
    set_epoch(epoch)
    s: Sender = Sender(addr)
    for m in msgs:
        s.put(m)
    set_epoch(mine)
    _senders.append(s)


def received(r: Receiver, timeout: float = 1.0) -> list[object]:
    out = []
    while (m := r.get(timeout)) is not None:
        out.append(m)
        timeout = 0.2
    return out


def test_under_the_launcher_everything_is_epoch_0_and_passes(addr: str) -> None:
    r: Receiver = Receiver(addr)
    send(addr, 0, AbortRequest(1), AbortRequest(2))
    assert [m.request_id for m in received(r)] == [1, 2]  # type: ignore[attr-defined]
    r.close()


def test_a_member_keeps_its_own_sets_messages_and_heartbeats_only(addr: str) -> None:
    set_epoch(5)
    r: Receiver = Receiver(addr)
    send(addr, 4, AbortRequest(40))  # from the set this one replaced
    send(addr, 5, AbortRequest(50))
    send(addr, 4, Heartbeat("scheduler", 0, 99, 4))  # says who is who: always delivered
    # Three senders are three connections: a PULL socket fair-queues them, in no set order.
    got = sorted(received(r), key=lambda m: type(m).__name__)
    assert [type(m).__name__ for m in got] == ["AbortRequest", "Heartbeat"]
    assert got[0].request_id == 50  # type: ignore[attr-defined]
    assert r._sorter.dropped == 1
    r.close()


def test_a_fresh_process_holds_stamped_messages_until_it_joins_a_set(addr: str) -> None:
    r: Receiver = Receiver(addr)  # epoch 0: not in a set yet
    send(addr, 7, AbortRequest(1))  # the old set's, delivered to the address it took over
    send(addr, 8, AbortRequest(2), AbortRequest(3))  # the set it is about to join
    assert received(r, 0.5) == []  # held, not delivered
    set_epoch(8)
    assert [m.request_id for m in r.drain()] == [2, 3]  # type: ignore[attr-defined]
    send(addr, 8, AbortRequest(4))
    assert [m.request_id for m in received(r)] == [4]  # type: ignore[attr-defined]
    assert r._sorter.dropped == 1
    r.close()


def test_drained_at_moves_only_when_the_inbox_is_found_empty(addr: str) -> None:
    r: Receiver = Receiver(addr)
    send(addr, 0, AbortRequest(1), AbortRequest(2))
    time.sleep(0.2)  # both delivered
    before = r.drained_at
    assert r.get(1.0) is not None  # a message was waiting: not drained
    assert r.drained_at == before
    r.drain()  # read to the end
    after = r.drained_at
    assert after > before
    assert r.get(0.05) is None and r.drained_at >= after
    r.close()
