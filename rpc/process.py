"""What every child process does first: name itself, die with its parent, log with its role."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # optional nicety; ps then shows the python command line
        pass


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the launcher dies, even by SIGKILL (Linux); handlers then clean up."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        stream=sys.stderr, force=True)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks close sockets and unlink segments."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides what Ctrl-C means


def init_child(role: str, level: str, parent_pid: int | None) -> None:
    set_title(f"tandem: {role}")
    setup_logging(role, level)
    exit_on_sigterm()
    if parent_pid:
        die_with_parent(parent_pid)
