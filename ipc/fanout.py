"""One sender, a known set of receivers that all get every message, in order: the plan
channel from gpu worker rank 0 to the other tensor-parallel ranks.

ZeroMQ XPUB/SUB with the msgpack codec and the epoch stamp, like every other channel. Plain
PUB drops what it sends before a subscriber has joined (the "slow joiner"); XPUB hands the
sender each subscription, so `wait_subscribers` returns only once every receiver is
listening and no plan is lost. With XPUB_VERBOSER it also hands over an unsubscription when
a receiver's connection closes (its process died, or, over TCP with ZeroMQ heartbeats on,
its host went silent): `lost()` tells the sender without any traffic of its own.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from tandem_serve.ipc.channels import DEFAULT_HWM, Receiver, bind_address, ipc_path, stamped

log = logging.getLogger(__name__)

# ZeroMQ's own heartbeats (ZMTP PING/PONG) on TCP: a peer whose host vanished is dropped
# after this long, which a closed socket would not tell us.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000
_SUBSCRIBE, _UNSUBSCRIBE = 1, 0
_CLOSE_LINGER_MS = 500  # a last Shutdown still reaches the receivers


class Fanout:
    """The sending side: `put(msg)` reaches every one of `receivers` subscribers."""

    def __init__(self, addr: str, receivers: int, hwm: int = DEFAULT_HWM) -> None:
        self.addr = addr
        self.receivers = receivers
        self.joined = 0
        self.left = 0
        ctx: zmq.Context = zmq.Context.instance()
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, not the first
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        path = ipc_path(addr)
        if path and os.path.exists(path):
            os.unlink(path)  # a stale file from a crashed run would make bind fail
        self.sock.bind(bind_address(addr))
        self._closed = False

    def _read_control(self, timeout_ms: int) -> None:
        """Count the (un)subscriptions waiting, waiting up to `timeout_ms` for the first."""
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            frame = self.sock.recv()
            if frame[:1] == bytes([_SUBSCRIBE]):
                self.joined += 1
            elif frame[:1] == bytes([_UNSUBSCRIBE]):
                self.left += 1

    def wait_subscribers(self, timeout: float) -> None:
        """Return once every receiver has subscribed; TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while self.joined < self.receivers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.joined} of {self.receivers} receivers subscribed "
                                   f"to {self.addr} within {timeout:g} s")
            self._read_control(int(min(left, 0.5) * 1000))
        log.debug("%d receivers subscribed to %s", self.joined, self.addr)

    def lost(self) -> bool:
        """Whether a receiver has gone since it subscribed (never blocks)."""
        self._read_control(0)
        return self.left > 0

    def put(self, msg: Any) -> None:
        self.sock.send_multipart(stamped(msg), copy=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sock.close(linger=_CLOSE_LINGER_MS)
        path = ipc_path(self.addr)
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def subscribe(addr: str, hwm: int = DEFAULT_HWM) -> Receiver[Any]:
    """The receiving side: a SUB socket connected to `addr`, subscribed to every message.

    It learns nothing by itself when the sender dies: the sender's heartbeat messages on
    the channel are what a receiver on another host watches."""
    rx: Receiver[Any] = Receiver(addr, bind=False, sub=True, hwm=hwm)
    return rx
