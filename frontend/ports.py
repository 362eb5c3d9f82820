"""The frontend's ports: checked before any process starts, bound the way servers bind them.

A port in use (or a host that is not an address of ours) is a user's mistake: it costs the
one-line `ipc.process.StartupError` naming the flag (exit status 2), not a traceback from
whichever server trips over it first.
"""
from __future__ import annotations

import socket

from tandem_serve.ipc.process import StartupError
from tandem_serve.proto.config import ServerConfig


def check_port(flag: str, host: str, port: int) -> None:
    """Fail now when `host:port` cannot be listened on (taken, or not an address of ours)."""
    if port:
        bound_socket(flag, host, port).close()


def bound_socket(flag: str, host: str, port: int) -> socket.socket:
    """A socket bound to `host:port`, or the one-line StartupError naming `flag`."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise StartupError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # As servers bind: a port in TIME_WAIT after a restart is free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise StartupError(f"{flag} {port}: cannot listen on {host}:{port} "
                           f"({exc.strerror}); choose a free port") from None
    return sock


def check_ports(cfg: ServerConfig) -> None:
    for flag, port in (("--port", cfg.port), ("--metrics-port", cfg.metrics_port),
                       ("--http-port", cfg.http_port)):
        check_port(flag, cfg.host, port)
