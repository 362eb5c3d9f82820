"""A TCP relay for one client connection whose server-to-client direction can be held.

A client that stops reading, made exact.  A gRPC client whose application reads nothing
still takes in what reaches its socket and, now and then, grants the server more HTTP/2
window for it; how much of a "stalled" stream it took in varied from a few KiB up to the
whole stream.  Held here, nothing reaches the client, so it grants nothing: the server's
writes stop once its stream window and its own write buffer are full, as they would for a
client whose process is stopped or whose network has gone quiet.
"""
from __future__ import annotations

import select
import socket
import threading

_CHUNK = 16384
_POLL_S = 0.05  # a held relay notices within this long that it flows again (or is closed)


class HeldRelay:
    """Listens on a free local port (`address`) and relays its first connection to `target`
    ("host:port").  `hold()` stops passing the server's bytes on (they wait in the kernel's
    socket buffers); `release()` passes them on again."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        for s in self._sockets:
            _close(s)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
            server = socket.create_connection(self._upstream)
        except OSError:
            return
        self._sockets += [client, server]
        if self._closed.is_set():
            self.close()
            return
        for src, dst, gate in ((client, server, None), (server, client, self._flowing)):
            threading.Thread(target=self._pump, args=(src, dst, gate), name="relay-pump",
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket,
              gate: threading.Event | None) -> None:
        try:
            while not self._closed.is_set():
                if gate is not None and not gate.wait(_POLL_S):
                    continue
                # Receive only while flowing: bytes taken in just before a hold would reach
                # the client after it, and buy the server more window.
                if not select.select([src], [], [], _POLL_S)[0]:
                    continue
                if gate is not None and not gate.is_set():
                    continue
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
