"""Start `tandem serve` as a real subprocess for end-to-end tests, and check it leaves nothing."""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tandem_serve.harness.processes import (
    free_port,  # noqa: F401  (tests import it from here)
)
from tandem_serve.harness.processes import (
    tree_pids as process_tree,
)
from tandem_serve.ipc.process import CLI
from tandem_serve.rpc.client import GenerateOptions, TandemClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree_pids(root: int) -> set[int]:
    """Every live descendant of `root` (from /proc)."""
    return set(process_tree(root)) - {root}


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


@functools.cache
def guided_cache_dir() -> str:
    """One guided-compile cache for the test session's servers, never the user's."""
    path = tempfile.mkdtemp(prefix="tandem-test-guided-")
    atexit.register(shutil.rmtree, path, True)
    return path


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    def __init__(self, model: str, *flags: str, env: dict[str, str] | None = None,
                 http: bool = False, cwd: str = ROOT) -> None:
        self.port = free_port()
        # The OpenAI-compatible API on a port of its own when asked (tests/conftest.py turns
        # it off by default: many servers run at once). Servers compile format=JSON at
        # start-up only in the tests that ask for it.
        self.http_port = free_port() if http else 0
        cmd = [*CLI, "serve", "--model", model,
               "--port", str(self.port), "--http-port", str(self.http_port),
               "--log-level", "WARNING", "--guided-cache-dir", guided_cache_dir(),
               "--no-guided-precompile-json", *flags]
        self.proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.client = TandemClient(f"127.0.0.1:{self.port}")
        self.children: set[int] = set()

    def wait_ready(self, timeout: float = 120.0) -> Server:
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

    def note_children(self) -> None:
        """Add processes started since wait_ready() (the guided compile worker starts on the
        first constraint) to those leftovers() checks."""
        self.children |= tree_pids(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.note_children()
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return int(self.proc.returncode)

    def wait_stats(self, ok: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        """The admin stats once `ok(stats)` holds: the scheduler reports them every 0.2 s, so
        a read right after a request ends can predate its last admissions and loads."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.client.stats()
            if ok(stats):
                return stats
            assert time.monotonic() < deadline, f"stats never settled: {stats}"
            time.sleep(0.05)

    def role_pids(self) -> dict[str, int]:
        """Child pids by role ("scheduler", "gpu-worker", "postproc 0", ...), from titles."""
        out = {}
        for pid in self.children:
            args = cmdline(pid)
            if args and args[0].startswith("tandem: "):
                out[args[0][len("tandem: "):].strip()] = pid
        return out

    def log(self, timeout: float = 10.0) -> str:
        """Everything the server wrote to stderr (waits for it to exit)."""
        self.proc.wait(timeout)
        return self.proc.stderr.read() if self.proc.stderr else ""

    def leftovers(self) -> list[str]:
        """Processes, shm segments and socket folders of this server still around."""
        out = [f"pid {p}" for p in self.children if alive(p)]
        tag = f"tandem_{self.proc.pid}_"
        out += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(tag)]
        tmp = tempfile.gettempdir()
        run_dir = f"tandem-{self.proc.pid}-"
        out += [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith(run_dir)]
        # A child started after wait_ready() took its snapshot: its --config-file names the
        # run folder.
        out += [f"pid {e} ({' '.join(cmdline(int(e))[:3])})" for e in os.listdir("/proc")
                if e.isdigit() and int(e) not in self.children and alive(int(e))
                and any(run_dir in a for a in cmdline(int(e)))]
        return out


def running(model: str, *flags: str, http: bool = False) -> Iterator[Server]:
    """A module fixture's server: SERVING for the tests, then stopped with exit code 0."""
    server = Server(model, *flags, http=http).wait_ready()
    try:
        yield server
    finally:
        assert server.stop() == 0


class Stream:
    """One GenerateStream read on its own thread; records how and when (wall clock) it ended."""

    def __init__(self, server: Server, text: str, max_new_tokens: int) -> None:
        self.opts = self.options(max_new_tokens)
        self.text = text
        self.client = server.client
        self.first_token = threading.Event()
        self.tokens = 0
        self.stop_reason = -1
        self.code: grpc.StatusCode | None = None  # None: ended normally
        self.details = ""
        self.ended_at = 0.0  # time.time(), comparable with other processes' log stamps
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def options(max_new_tokens: int) -> GenerateOptions:
        """Exactly `max_new_tokens` greedy tokens (EOS does not end it early)."""
        return GenerateOptions(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)

    def _run(self) -> None:
        try:
            for resp in self.client.stream(self.text, self.opts):
                if resp.generated_token_count:
                    self.tokens = resp.generated_token_count
                    self.first_token.set()
                self.stop_reason = resp.stop_reason
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        finally:
            self.ended_at = time.time()
            self.first_token.set()  # an early end releases waiters too

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()
