"""Process control: shutdown, readiness, and the supervision reports of a hung or failed
process.

Every message is registered with the codec in `proto.messages.MESSAGE_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shutdown:
    reason: str = ""


@dataclass
class Ready:
    """A child process reports that its sockets are up."""

    role: str
    index: int = 0


@dataclass
class WorkerHung:
    """Scheduler -> launcher: plan `plan_id` has been running `seconds`, past step_timeout."""

    plan_id: int
    seconds: float
    role: str = "gpu-worker"


@dataclass
class ProcessFailed:
    """A child -> launcher: this process is dying of an exception (sent as it unwinds)."""

    role: str
    pid: int
    error: str  # "ExceptionType: message", shortened; a start-up mistake's message alone
    peer_died: bool = False  # the error says another process died: a consequence, not a cause
    # A mistake in how the server was started (a model it cannot load, a device it lacks):
    # the launcher prints the message as one line and exits 2 (`ipc.process.StartupError`).
    startup: bool = False
