"""Start `tandem serve` as a real subprocess for end-to-end tests, and check it leaves nothing."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from rpc.client import TandemClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_pids(root: int) -> set[int]:
    """Every live descendant of `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    def __init__(self, model: str, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "rpc.cli", "serve", "--model", model,
               "--port", str(self.port), "--log-level", "WARNING", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.client = TandemClient(f"127.0.0.1:{self.port}")
        self.children: set[int] = set()

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: "
                                   f"{self.proc.stderr.read() if self.proc.stderr else ''}")
            if self.client.is_serving():
                self.children = tree_pids(self.proc.pid)
                return self
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return int(self.proc.returncode)

    def leftovers(self) -> list[str]:
        """Processes, shm segments and socket folders of this server still around."""
        out = [f"pid {p}" for p in self.children if alive(p)]
        tag = f"tandem_{self.proc.pid}_"
        out += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(tag)]
        tmp = tempfile.gettempdir()
        out += [os.path.join(tmp, n) for n in os.listdir(tmp)
                if n.startswith(f"tandem-{self.proc.pid}-")]
        return out


def running(model: str, *flags: str) -> Iterator[Server]:
    server = Server(model, *flags).wait_ready()
    try:
        yield server
    finally:
        server.stop()
