"""Fault injection for failure tests: make one process raise, exit or hang at a chosen plan.

The spec comes from `ServerConfig.fault`, which `tandem.cli` fills from the `TANDEM_FAULT`
environment variable (the CLI is the one place that reads the environment).  Syntax::

    ROLE:plan=N:ACTION[,ROLE:plan=N:ACTION ...]

ROLE is `scheduler`, `gpu-worker` or `postprocI` (I = worker index; `postproc 0` and
`postproc-0` mean the same).  ACTION is one of

    raise   an exception unwinds the process (its `finally` blocks run, exit code 1)
    exit    os._exit at once: no cleanup, like a crash
    kill    SIGKILL to itself
    hang    sleep forever; SIGTERM still ends it (a stuck device call might not, which is
            why the launcher escalates to SIGKILL)

A fault fires once, at the first plan whose id is >= N that the process handles (a
postproc worker may see no batch of a plan in which nothing ran).  Each process calls
`maybe_fire(role, plan_id)` once per plan; with no spec that is one truth test.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("tandem.faults")

ACTIONS = ("raise", "exit", "kill", "hang")
EXIT_CODE = 3  # of the `exit` action: distinct from 1 (an exception) in the launcher's log


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


@dataclass
class Fault:
    role: str  # normalized: no spaces or dashes
    plan: int
    action: str
    fired: bool = False


def _norm(role: str) -> str:
    return role.replace(" ", "").replace("-", "").replace("_", "").lower()


def parse(spec: str) -> list[Fault]:
    """The faults of a spec; ValueError names the part it cannot read."""
    faults: list[Fault] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) != 3 or not fields[1].startswith("plan="):
            raise ValueError(f"fault {part!r}: expected ROLE:plan=N:ACTION")
        role, plan, action = fields[0], fields[1][len("plan="):], fields[2]
        if action not in ACTIONS:
            raise ValueError(f"fault {part!r}: action must be one of {', '.join(ACTIONS)}")
        if not plan.isdigit():
            raise ValueError(f"fault {part!r}: plan must be a non-negative integer")
        faults.append(Fault(_norm(role), int(plan), action))
    return faults


_faults: list[Fault] = []


def configure(spec: str) -> None:
    """Arm the faults of `spec` in this process (replacing any armed before)."""
    global _faults
    _faults = parse(spec)
    if _faults:
        log.warning("fault injection armed: %s", spec)


def maybe_fire(role: str, plan_id: int) -> None:
    """Fire the armed fault of `role` once `plan_id` reaches its plan; else return at once."""
    if not _faults:
        return
    name = _norm(role)
    for fault in _faults:
        if fault.fired or fault.role != name or plan_id < fault.plan:
            continue
        fault.fired = True
        # The wall-clock stamp lets a test measure how fast the failure reached the clients.
        log.error("fault injected: %s %s at plan %d (wall %.3f)", role, fault.action, plan_id,
                  time.time())
        sys.stderr.flush()
        _fire(fault.action, role, plan_id)


def _fire(action: str, role: str, plan_id: int) -> None:
    if action == "raise":
        raise InjectedFault(f"injected fault: {role} raised at plan {plan_id}")
    if action == "exit":
        os._exit(EXIT_CODE)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang; short sleeps so SIGTERM's SystemExit gets in promptly
        time.sleep(0.5)
