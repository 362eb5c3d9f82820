"""The plan channel: every receiver gets every message in order, none is lost to a late
subscription, and the sender learns when a receiver's process dies."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from tandem_serve.ipc.fanout import Fanout, subscribe
from tandem_serve.proto.control_messages import Shutdown
from tandem_serve.proto.monitor_messages import Heartbeat

ROOT = str(pathlib.Path(__file__).resolve().parents[2])

RECEIVER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from tandem_serve.ipc.fanout import subscribe
rx = subscribe(sys.argv[1])
print("subscribed", flush=True)
rx.get(timeout=30)  # then dies without closing anything
"""


def test_every_receiver_gets_everything_in_order(tmp_path: pathlib.Path) -> None:
    addr = f"ipc://{tmp_path}/plans"
    tx = Fanout(addr, receivers=2)
    rxs = [subscribe(addr), subscribe(addr)]
    try:
        tx.wait_subscribers(10.0)
        for i in range(50):  # sent at once: nothing before the subscriptions landed is lost
            tx.put(Heartbeat("gpu-worker 0/3", i))
        tx.put(Shutdown("done"))
        for rx in rxs:
            got = [rx.get(timeout=5) for _ in range(51)]
            assert [m.index for m in got[:50]] == list(range(50))  # type: ignore[union-attr]
            assert got[50] == Shutdown("done")
        assert not tx.lost()
    finally:
        for rx in rxs:
            rx.close()
        tx.close()
    assert not (tmp_path / "plans").exists()


def test_missing_receivers_time_out_by_name(tmp_path: pathlib.Path) -> None:
    tx = Fanout(f"ipc://{tmp_path}/plans", receivers=2)
    rx = subscribe(f"ipc://{tmp_path}/plans")
    try:
        with pytest.raises(TimeoutError, match="1 of 2 receivers"):
            tx.wait_subscribers(0.5)
    finally:
        rx.close()
        tx.close()


def test_a_receiver_that_dies_is_noticed(tmp_path: pathlib.Path) -> None:
    addr = f"ipc://{tmp_path}/plans"
    tx = Fanout(addr, receivers=1)
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, addr, ROOT],
                            stdout=subprocess.PIPE, text=True)
    try:
        tx.wait_subscribers(30.0)
        assert not tx.lost()
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while not tx.lost() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tx.lost()
    finally:
        if proc.poll() is None:
            proc.kill()
        tx.close()
