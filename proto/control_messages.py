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


# Rollout controls (`frontend/engine_control.py`): the frontend asks the scheduler, which
# pauses planning itself and hands the operations on the model to the gpu worker through its
# plan channel once no request is running, so a control never lands inside a plan.
CONTROL_OPS = ("pause", "resume", "reset_prefix_cache", "sleep", "wake_up", "load_weights")
WORKER_OPS = ("sleep", "wake_up", "load_weights")  # done by the gpu worker (every rank)


@dataclass
class EngineControl:
    """Frontend -> scheduler (-> gpu worker for WORKER_OPS): one rollout control."""

    seq: int  # the frontend's number for it; the answer carries it back
    op: str  # one of CONTROL_OPS
    level: int = 1  # sleep: 1 keeps the weights in host memory, 2 drops them
    path: str = ""  # load_weights: the checkpoint folder


@dataclass
class ControlDone:
    """Scheduler or gpu worker rank 0 -> frontend: a control's outcome."""

    seq: int
    error: str = ""  # empty: done
    seconds: float = 0.0  # how long the work took where it was done
    detail: str = ""  # e.g. how many cached blocks a reset dropped
