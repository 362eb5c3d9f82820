"""Typed ZeroMQ queues: one wrapper per channel, `put(msg)`, `get(timeout)`, `poll`, `close`.

Every process has one inbox (a PULL socket it binds); its peers PUSH into it.  Token
batches go over the shared-memory ring (`ipc.shm_ring`) or, across hosts, a PUB/SUB pair.

Epochs.  Roles started on their own (one container each) serve as a *set* that the frontend
names with a random epoch (`ipc.peers`); a set whose member died is replaced as a whole.  A
process of the old set may still send for a moment after its replacement has come up at the
same address, so every message carries its sender's epoch in a first frame, and a receiver
keeps only messages of its own epoch (heartbeats, which say who is who, always pass).  A
process that has not joined a set yet (epoch 0) holds what comes stamped with another epoch
and, once it joins one, delivers what was stamped with that epoch and drops the rest.  Under
the launcher every process stays at epoch 0 and nothing is ever held or dropped.
"""
from __future__ import annotations

import collections
import logging
import os
import struct
import time
from typing import Any, Generic, TypeVar

import zmq

from tandem_serve.proto import codec
from tandem_serve.proto.monitor_messages import Heartbeat

log = logging.getLogger(__name__)

T = TypeVar("T")

# Bounded everywhere: a stuck peer makes the sender block (and then fail loudly) instead of
# letting memory grow without limit.
DEFAULT_HWM = 10_000
# How long ZeroMQ's I/O thread may go on delivering a closed sender's queue.
SEND_FLUSH_MS = 1000


def ipc_path(addr: str) -> str | None:
    return addr[len("ipc://"):] if addr.startswith("ipc://") else None


def bind_address(addr: str) -> str:
    """Bind tcp on every interface: peers reach us by a service name that, inside a
    container, may not resolve to the address we should listen on."""
    if addr.startswith("tcp://"):
        return "tcp://*:" + addr.rsplit(":", 1)[1]
    return addr


_STAMP = struct.Struct("<q")
_epoch = 0  # this process's set; 0: none (under the launcher, or not joined yet)
HELD_LIMIT = 10_000  # messages an unjoined process keeps for the set it may join


def set_epoch(epoch: int) -> None:
    """Join the set `epoch` (the frontend's): stamp ours with it, keep only its messages."""
    global _epoch
    _epoch = epoch


def current_epoch() -> int:
    return _epoch


def stamped(msg: Any) -> list[Any]:
    """The frames of `msg` with this process's epoch in front."""
    return [_STAMP.pack(_epoch), *codec.encode(msg)]


class _Sorter:
    """Which received messages to keep, by their epoch stamp (see the module docstring)."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._held: collections.deque[tuple[int, Any]] = collections.deque(maxlen=HELD_LIMIT)
        self._released: collections.deque[Any] = collections.deque()
        self._seen_epoch = _epoch
        self.dropped = 0

    def sort(self, frames: list[Any]) -> Any:
        """The message in `frames` if it is ours now, else None (held or dropped)."""
        if len(frames) < 2 or len(frames[0]) != _STAMP.size:
            log.error("dropping a message without an epoch stamp on %s", self.addr)
            return None
        (stamp,) = _STAMP.unpack(frames[0])
        try:
            msg = codec.decode(frames[1:])
        except codec.CodecError as exc:
            log.error("dropping a malformed message on %s: %s", self.addr, exc)
            return None
        if stamp == _epoch or isinstance(msg, Heartbeat):
            return msg
        if _epoch == 0:  # not in a set yet: this may be the set we are about to join
            self._held.append((stamp, msg))
        else:
            self.dropped += 1
            log.debug("dropping a %s of epoch %x on %s (ours: %x)", type(msg).__name__, stamp,
                      self.addr, _epoch)
        return None

    def released(self) -> Any:
        """A held message of the set this process has joined since, oldest first."""
        if self._seen_epoch != _epoch:
            self._seen_epoch = _epoch
            keep = [m for stamp, m in self._held if stamp == _epoch] if _epoch else []
            self.dropped += len(self._held) - len(keep)
            self._released.extend(keep)
            self._held.clear()
        return self._released.popleft() if self._released else None


def _readable(sock: zmq.Socket) -> bool:
    """A message is waiting (a socket option read, no system call on the data path)."""
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


class _Socket:
    def __init__(self, addr: str, kind: int, bind: bool, hwm: int = DEFAULT_HWM) -> None:
        self.addr = addr
        self._bind = bind
        self._ctx: zmq.Context = zmq.Context.instance()
        self.sock = self._ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        if bind:
            path = ipc_path(addr)
            if path and os.path.exists(path):
                os.unlink(path)  # a stale file from a crashed run would make bind fail
            self.sock.bind(bind_address(addr))
        else:
            self.sock.connect(addr)
        self._closed = False

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 lets ZeroMQ's I/O thread go on delivering what was queued
        (a role's last reply) for that long instead of dropping it with the socket."""
        if self._closed:
            return
        self._closed = True
        self.sock.close(linger=linger_ms)
        path = ipc_path(self.addr)
        if self._bind and path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class Sender(_Socket, Generic[T]):
    """PUSH (or PUB) side of a channel."""

    def __init__(self, addr: str, bind: bool = False, pub: bool = False,
                 hwm: int = DEFAULT_HWM) -> None:
        super().__init__(addr, zmq.PUB if pub else zmq.PUSH, bind, hwm)

    def close(self, linger_ms: int = SEND_FLUSH_MS) -> None:
        """What was put just before closing (a role's Ready, its ProfileData) still goes,
        within `linger_ms`."""
        super().close(linger_ms)

    def put(self, msg: T, timeout: float | None = None) -> None:
        frames = stamped(msg)
        if timeout is None:
            self.sock.send_multipart(frames, copy=False)
            return
        if not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise TimeoutError(f"channel {self.addr} is full (peer not reading)")
        self.sock.send_multipart(frames, copy=False)


class Receiver(_Socket, Generic[T]):
    """PULL (or SUB) side of a channel.  Malformed frames are logged and skipped."""

    def __init__(self, addr: str, bind: bool = True, sub: bool = False,
                 hwm: int = DEFAULT_HWM) -> None:
        super().__init__(addr, zmq.SUB if sub else zmq.PULL, bind, hwm)
        if sub:
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sorter = _Sorter(addr)
        # When this inbox was last found empty: a peer is silent only if nothing of it was
        # waiting here then (a busy process reads its heartbeats late, it does not miss them).
        self.drained_at = time.monotonic()

    def poll(self, timeout: float | None) -> bool:
        ms = None if timeout is None else int(timeout * 1000)
        return bool(self.sock.poll(ms, zmq.POLLIN))

    def get(self, timeout: float | None = None) -> T | None:
        """Next message, or None when `timeout` seconds pass without one."""
        while True:
            held = self._sorter.released()
            if held is not None:
                return held
            if not _readable(self.sock):
                self.drained_at = time.monotonic()
            if not self.poll(timeout):
                return None
            msg = self.get_nowait_raw()
            if msg is not None:
                return msg

    def get_nowait_raw(self) -> Any:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._sorter.sort([f.buffer for f in frames])

    def drain(self) -> list[T]:
        """Every message already waiting, without blocking."""
        out: list[T] = []
        while (held := self._sorter.released()) is not None:
            out.append(held)
        while self.sock.poll(0, zmq.POLLIN):
            msg = self.get_nowait_raw()
            if msg is not None:
                out.append(msg)
        self.drained_at = time.monotonic()
        return out


class AsyncReceiver(Generic[T]):
    """PULL side for asyncio code (the frontend); same framing and error handling."""

    def __init__(self, addr: str, bind: bool = True, hwm: int = DEFAULT_HWM) -> None:
        import zmq.asyncio

        self.addr = addr
        self._bind = bind
        self.sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        path = ipc_path(addr)
        if bind:
            if path and os.path.exists(path):
                os.unlink(path)
            self.sock.bind(bind_address(addr))
        else:
            self.sock.connect(addr)
        self._sorter = _Sorter(addr)
        self.drained_at = time.monotonic()  # as Receiver.drained_at

    async def get(self) -> T:
        while True:
            held = self._sorter.released()
            if held is not None:
                return held
            if not _readable(self.sock):
                self.drained_at = time.monotonic()
            frames = await self.sock.recv_multipart(copy=False)
            msg = self._sorter.sort([f.buffer for f in frames])
            if msg is not None:
                return msg

    def close(self) -> None:
        self.sock.close(linger=0)
        path = ipc_path(self.addr)
        if self._bind and path and os.path.exists(path):
            os.unlink(path)
