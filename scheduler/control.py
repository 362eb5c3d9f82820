"""The rollout controls' side of planning (`proto.control_messages.EngineControl`).

Two switches and a queue, kept apart from the planner so the rest of it does not change:

* `paused` (pause / resume): no plan is built.  Running requests keep their KV blocks and
  their place, and continue exactly where they stopped on resume, so a stream in flight
  only sees a gap; new requests queue.  Nothing is aborted or fails.
* the operations on the model (sleep, wake_up, load_weights) wait in `pending` until no
  request is running (admission stops meanwhile, the running ones finish), then go to the
  gpu worker on the plan channel, behind every plan sent before them.  While asleep nothing
  is admitted: a request that arrives then waits in the queue for wake_up.  Paused,
  load_weights goes at once (the paused requests continue on the new weights); sleep
  would free the KV the paused requests still need, so it is refused until resume.

A control that changes what a block's KV means (sleep frees the cache, new weights make it
stale) resets the prefix cache first, through `Scheduler.reset_prefix_cache`, the one place
that clears the index.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tandem_serve.proto.control_messages import WORKER_OPS, ControlDone, EngineControl


class ControlGate:
    """What the controls hold back: plans (paused), admission (asleep or a model operation
    waiting), and the model operations waiting for the running requests to finish."""

    def __init__(self) -> None:
        self.paused = False
        self.asleep = False
        self.pending: deque[EngineControl] = deque()

    def holds_admission(self) -> bool:
        return self.asleep or bool(self.pending)


class ControlHandler:
    """The scheduler process's handling of `EngineControl`: answers its own operations at
    once, and forwards the model's to the worker once `take_ready` finds them runnable."""

    def __init__(self, gate: ControlGate, reset_cache: Callable[[], int],
                 reply: Callable[[ControlDone], None],
                 to_worker: Callable[[EngineControl], None]) -> None:
        self.gate, self.reset_cache, self.reply, self.to_worker = gate, reset_cache, reply, \
            to_worker

    def on_control(self, msg: EngineControl) -> None:
        if msg.op in WORKER_OPS:
            self.gate.pending.append(msg)
            return
        if msg.op == "pause":
            self.gate.paused = True
            self.reply(ControlDone(msg.seq))
        elif msg.op == "resume":
            self.gate.paused = False
            self.reply(ControlDone(msg.seq))
        elif msg.op == "reset_prefix_cache":
            t0 = time.monotonic()
            dropped = self.reset_cache()
            self.reply(ControlDone(msg.seq, seconds=time.monotonic() - t0,
                                   detail=f"{dropped} cached blocks dropped"))
        else:
            self.reply(ControlDone(msg.seq, error=f"unknown control {msg.op!r}"))

    def forward_ready(self, num_running: int) -> None:
        """Send the waiting model operations on whose turn has come (called after each
        receive, once plans are built)."""
        gate = self.gate
        while gate.pending:
            msg = gate.pending[0]
            if msg.op == "sleep" and gate.paused and num_running:
                gate.pending.popleft()
                self.reply(ControlDone(msg.seq, error=f"sleep while paused with {num_running} "
                                       f"requests in flight would lose their KV cache; resume "
                                       f"first (they finish, then the engine sleeps)"))
                continue
            if num_running and not (msg.op == "load_weights" and gate.paused):
                return  # they finish first; admission is held meanwhile
            gate.pending.popleft()
            if msg.op in ("sleep", "load_weights"):
                self.reset_cache()
            if msg.op == "sleep":
                gate.asleep = True
            elif msg.op == "wake_up":
                gate.asleep = False
            self.to_worker(msg)  # the worker answers the frontend
