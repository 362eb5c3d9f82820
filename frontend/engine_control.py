"""The rollout controls, for the offline `LLM` and the HTTP control endpoints alike.

RL frameworks drive the engine between training steps: sleep to give the accelerator's
memory to the trainer, load the new weights, wake up, generate again; pause and resume
around a weight update; reset the prefix cache when its KV no longer matches the weights.
Each control is one `EngineControl` to the scheduler, answered by one `ControlDone` from
the scheduler (pause, resume, reset_prefix_cache) or from gpu worker rank 0 (sleep, wake_up,
load_weights, which the scheduler hands on once no request is running:
`scheduler/control.py`).  Model operations run one at a time, in the order asked.

Requests are never failed by a control: paused, running requests wait and then finish;
asleep, a new request waits in the queue until wake_up (it does not get a 503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

from tandem_serve.frontend.engine_client import EngineClient, EngineError
from tandem_serve.proto.control_messages import ControlDone, EngineControl

log = logging.getLogger("tandem.frontend")

DEAD_CHECK_S = 0.5  # how often a wait for an answer looks whether the engine died


@dataclass(frozen=True)
class ControlResult:
    """What a control did: the seconds its work took where it ran, and a note (memory
    before and after for the worker's operations, blocks dropped for a reset)."""

    op: str
    seconds: float
    detail: str


class EngineControls:
    """Sends the controls and waits for their answers; knows whether the engine sleeps."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        engine.on_control = self._answered
        self._seq = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[ControlDone]] = {}
        self._model_ops = asyncio.Lock()  # one sleep / wake / load at a time, in order
        self.sleep_level = 0  # 0: awake
        self.paused = False

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    async def sleep(self, level: int = 1) -> ControlResult:
        """Free the KV cache (1) and the weights too (2), once the running requests finished."""
        if level not in (1, 2):
            raise EngineError("INVALID_ARGUMENT", f"level: must be 1 or 2, got {level}")
        async with self._model_ops:
            result = await self._ask(EngineControl(0, "sleep", level=level))
            self.sleep_level = max(self.sleep_level, level)
            return result

    async def wake_up(self) -> ControlResult:
        async with self._model_ops:
            result = await self._ask(EngineControl(0, "wake_up"))
            self.sleep_level = 0
            return result

    async def load_weights(self, path: str) -> ControlResult:
        """Replace the weights in place from a checkpoint folder of the same architecture
        (every tensor-parallel rank reads its shard); the prefix cache is reset."""
        if not isinstance(path, str) or not path:
            raise EngineError("INVALID_ARGUMENT", "path: must be a checkpoint folder")
        async with self._model_ops:
            return await self._ask(EngineControl(0, "load_weights", path=path))

    async def pause(self) -> ControlResult:
        """No plan is built from now on; returns at once (running requests wait)."""
        result = await self._ask(EngineControl(0, "pause"))
        self.paused = True
        return result

    async def resume(self) -> ControlResult:
        result = await self._ask(EngineControl(0, "resume"))
        self.paused = False
        return result

    async def reset_prefix_cache(self) -> ControlResult:
        return await self._ask(EngineControl(0, "reset_prefix_cache"))

    # ------------------------------------------------------------------ the exchange

    async def _ask(self, msg: EngineControl) -> ControlResult:
        if self.engine.dead:
            raise EngineError("UNAVAILABLE", self.engine.dead)
        msg.seq = next(self._seq)
        answer: asyncio.Future[ControlDone] = asyncio.get_running_loop().create_future()
        self._waiting[msg.seq] = answer
        try:
            self.engine.control(msg)
            while not answer.done():
                await asyncio.wait({answer}, timeout=DEAD_CHECK_S)
                if self.engine.dead and not answer.done():
                    raise EngineError("UNAVAILABLE", self.engine.dead)
        finally:
            self._waiting.pop(msg.seq, None)
        done = answer.result()
        if done.error:
            raise EngineError("INVALID_ARGUMENT", f"{msg.op}: {done.error}")
        log.info("%s done (%.2f s%s)", msg.op, done.seconds,
                 f", {done.detail}" if done.detail else "")
        return ControlResult(msg.op, done.seconds, done.detail)

    def _answered(self, msg: ControlDone) -> None:
        answer = self._waiting.get(msg.seq)
        if answer is not None and not answer.done():
            answer.set_result(msg)
