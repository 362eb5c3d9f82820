"""What `scripts/gpu-check` does so that no stage outlives its time, nor leaves a process.

A stage starts servers (`tandem serve`, whose launcher starts the roles), tools that start
servers of their own (`tandem bench stall`, `bench spec`), test runs and probe processes.
Killing the direct child on a timeout is not enough: its servers are orphaned and keep their
models in memory.  So:

* gpu-check makes itself the *subreaper* of its descendants (Linux): an orphan moves into its
  tree rather than to init, and a sweep of its descendants finds it;
* each stage runs under `StageSupervisor.stage`: what it starts is every descendant that was not
  there before it; at its deadline the guard ends that process tree (SIGTERM, then SIGKILL)
  and raises `StageTimeout` in the main thread (a signal to that thread, so a blocking wait
  is interrupted too); when the stage ends in any way, whatever it left running is ended
  and counted in its report;
* `tandem` (a `tandem` command as a subprocess) starts it in its own session and ends its
  whole tree on a timeout;
* at exit (normal, an exception, SIGTERM, Ctrl-C) every descendant is ended.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tandem_serve.harness.processes import (
    REPO_ROOT,
    descendants,
    end_processes,
    role_of,
    set_child_subreaper,
    tree_pids,
)
from tandem_serve.ipc.process import CLI

END_GRACE_S = 10.0  # SIGTERM to SIGKILL: a server's launcher stops its roles in a few seconds
# After a stage returns: how long its processes may take to exit on their own (a stopped
# server's roles can outlive their launcher by a moment) before they count as left running.
SETTLE_S = 3.0


class StageTimeout(BaseException):
    """A stage ran past its deadline (a BaseException: a stage's `except Exception` must not
    swallow it, as with KeyboardInterrupt)."""


@dataclass
class StageRun:
    """One supervised stage: whether it timed out, and the processes it left behind."""

    timeout_s: float
    timed_out: bool = False
    left_behind: list[str] = field(default_factory=list)  # roles of what it left running
    started: float = field(default_factory=time.monotonic)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


class StageSupervisor:
    """Subreaper, stage guards, and the sweep at exit (one per gpu-check run)."""

    def __init__(self) -> None:
        self.subreaper = set_child_subreaper()
        self._active: StageRun | None = None
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        self._baseline = descendants()
        # Interrupting a stage needs a handler in the main thread (elsewhere, e.g. a test's
        # thread, a stage past its deadline has its processes ended and returns by itself).
        self._interrupts = threading.current_thread() is threading.main_thread()
        if self._interrupts:
            signal.signal(signal.SIGUSR2, self._on_timeout_signal)
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _exit_on_sigterm)
        atexit.register(self.end_all)

    def _on_timeout_signal(self, signum: int, frame: object) -> None:
        run = self._active
        if run is not None and run.timed_out:
            raise StageTimeout(f"timed out after {run.timeout_s:.0f} s")

    def end_all(self) -> int:
        """End every descendant this run started; how many there were."""
        left = descendants() - self._baseline
        if left:
            end_processes(left, END_GRACE_S, rescan=os.getpid())
        return len(left)

    @contextlib.contextmanager
    def stage(self, timeout_s: float) -> Iterator[StageRun]:
        """Run the body as one stage of at most `timeout_s` seconds (see the module doc)."""
        before = descendants()
        run = StageRun(timeout_s)

        def expire() -> None:
            with self._lock:
                if self._active is not run:
                    return
                run.timed_out = True
            end_processes(descendants() - before, END_GRACE_S, rescan=os.getpid())
            if self._active is run and self._interrupts and self._main is not None:
                signal.pthread_kill(self._main, signal.SIGUSR2)

        timer = threading.Timer(max(timeout_s, 0.0), expire)
        timer.daemon = True
        self._active = run
        timer.start()
        try:
            yield run
        finally:
            with self._lock:
                self._active = None
            timer.cancel()
            left = _settle(before, 0.0 if run.timed_out else SETTLE_S)
            if left:
                run.left_behind = sorted(role_of(p) for p in left)
                end_processes(left, END_GRACE_S, rescan=os.getpid())


def _settle(before: set[int], wait_s: float) -> set[int]:
    """Descendants not in `before` once they stop exiting on their own (at most `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = descendants() - before
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # atexit then ends every descendant


def end_tree(proc: subprocess.Popen) -> None:
    """End `proc` and every process under it (its own session first: what has not left it)."""
    pids = set(tree_pids(proc.pid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    end_processes(pids, END_GRACE_S, rescan=os.getpid())
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def run_tree(cmd: Sequence[str], timeout: float, cwd: str = REPO_ROOT,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`cmd` in a session of its own, output captured; on a timeout its whole process tree
    is ended and `subprocess.TimeoutExpired` raised (`subprocess.run` kills the child only,
    and would orphan its servers)."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout, 1.0))
    except BaseException:  # the timeout, a stage's own timeout, Ctrl-C: nothing stays
        end_tree(proc)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=5)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def tandem(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`tandem ARGS` from this checkout (see `run_tree`)."""
    return run_tree([*CLI, *args], timeout)
