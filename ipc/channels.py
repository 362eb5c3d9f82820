"""Typed ZeroMQ queues: one wrapper per channel, `put(msg)`, `get(timeout)`, `poll`, `close`.

Every process has one inbox (a PULL socket it binds); its peers PUSH into it.  Token
batches go over the shared-memory ring (`ipc.shm_ring`) or, across hosts, a PUB/SUB pair.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Generic, TypeVar

import zmq

from proto import codec

log = logging.getLogger(__name__)

T = TypeVar("T")

# Bounded everywhere: a stuck peer makes the sender block (and then fail loudly) instead of
# letting memory grow without limit.
DEFAULT_HWM = 10_000


def _ipc_path(addr: str) -> str | None:
    return addr[len("ipc://"):] if addr.startswith("ipc://") else None


def bind_address(addr: str) -> str:
    """Bind tcp on every interface: peers reach us by a service name that, inside a
    container, may not resolve to the address we should listen on."""
    if addr.startswith("tcp://"):
        return "tcp://*:" + addr.rsplit(":", 1)[1]
    return addr


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
            path = _ipc_path(addr)
            if path and os.path.exists(path):
                os.unlink(path)  # a stale file from a crashed run would make bind fail
            self.sock.bind(bind_address(addr))
        else:
            self.sock.connect(addr)
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sock.close(linger=0)
        path = _ipc_path(self.addr)
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

    def put(self, msg: T, timeout: float | None = None) -> None:
        frames = codec.encode(msg)
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

    def poll(self, timeout: float | None) -> bool:
        ms = None if timeout is None else int(timeout * 1000)
        return bool(self.sock.poll(ms, zmq.POLLIN))

    def get(self, timeout: float | None = None) -> T | None:
        """Next message, or None when `timeout` seconds pass without one."""
        while True:
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
        try:
            return codec.decode([f.buffer for f in frames])
        except codec.CodecError as exc:
            log.error("dropping a malformed message on %s: %s", self.addr, exc)
            return None

    def drain(self) -> list[T]:
        """Every message already waiting, without blocking."""
        out: list[T] = []
        while self.sock.poll(0, zmq.POLLIN):
            msg = self.get_nowait_raw()
            if msg is not None:
                out.append(msg)
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
        path = _ipc_path(addr)
        if bind:
            if path and os.path.exists(path):
                os.unlink(path)
            self.sock.bind(bind_address(addr))
        else:
            self.sock.connect(addr)

    async def get(self) -> T:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                return codec.decode([f.buffer for f in frames])
            except codec.CodecError as exc:
                log.error("dropping a malformed message on %s: %s", self.addr, exc)

    def close(self) -> None:
        self.sock.close(linger=0)
        path = _ipc_path(self.addr)
        if self._bind and path and os.path.exists(path):
            os.unlink(path)
