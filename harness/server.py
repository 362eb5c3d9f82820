"""A `tandem serve` for a benchmark: started on free ports from the checkout, waited for
until SERVING, asked for its admin counters and idleness, stopped."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tandem_serve.harness.processes import REPO_ROOT, free_port, stop_process
from tandem_serve.ipc.process import CLI

SERVING_TIMEOUT_S = 300.0
POLL_S = 0.2


def start_server(model: str, flags: Sequence[str], port: int, http_port: int = 0, *,
                 quiet: bool = False) -> subprocess.Popen:
    """`tandem serve` on `port` (and `http_port`; 0: no HTTP API); `flags` come last, so they
    override. `quiet` drops its stdout; its log (stderr) goes where this process's goes."""
    cmd = [*CLI, "serve", "--port", str(port), "--http-port", str(http_port),
           "--log-level", "WARNING", *(["--model", model] if model else []), *flags]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL if quiet else None)


def wait_serving(client: Any, proc: subprocess.Popen | None, timeout: float) -> None:
    """Until `client`'s server reports SERVING; an error once `proc` exits or time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} while starting")
        if client.is_serving():
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"server not serving after {timeout:g} s")


@dataclass
class Served:
    """A started server, SERVING, and a gRPC client of it."""

    proc: subprocess.Popen
    client: Any  # rpc.client.TandemClient
    port: int
    http_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def serving(model: str, flags: Sequence[str], *, http: bool = False, quiet: bool = False,
            timeout: float = SERVING_TIMEOUT_S) -> Iterator[Served]:
    """A fresh server on free ports, SERVING; stopped on exit (even when it never served)."""
    from tandem_serve.rpc.client import TandemClient

    port = free_port()
    http_port = free_port() if http else 0
    proc = start_server(model, flags, port, http_port, quiet=quiet)
    client = TandemClient(f"127.0.0.1:{port}")
    try:
        wait_serving(client, proc, timeout)
        yield Served(proc, client, port, http_port)
    finally:
        client.close()
        stop_process(proc)


def engine_counters(client: Any) -> dict[str, float]:
    """The numeric fields of the server's admin Stats."""
    s = client.stats()
    values = {f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


def wait_idle(client: Any, timeout: float = 60.0) -> Any:
    """The admin stats once every block is free and nothing runs or waits (else the last)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if (s.num_free_blocks, s.num_running, s.num_waiting) == (s.num_total_blocks, 0, 0):
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.05)
