"""The frontend of roles started on their own (`tandem run-role frontend`, as compose runs it).

It keeps a complete set of roles serving (`ipc.peers`): it admits fresh processes, and when
a member dies, restarts or reports a failure, it replaces the whole set while it keeps
serving gRPC itself: health NOT_SERVING, every open stream and every new request answered
UNAVAILABLE with the reason, a new epoch, the old set's processes exit and are restarted by
the orchestrator, and once the new set has handshaked and a warm-up request went through,
SERVING again.  The frontend holds nothing of the set's state, so it never has to restart.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tandem_serve.frontend.frontend import Frontend
from tandem_serve.ipc.peers import frontend_watch
from tandem_serve.proto.config import ServerConfig

log = logging.getLogger("tandem.frontend")

POLL_S = 0.1
WAITING_NOTE_S = 30.0  # how often to say which roles the frontend is still waiting for


class SetKeeper:
    def __init__(self, cfg: ServerConfig, frontend: Frontend,
                 not_serving: Callable[[], Awaitable[None]],
                 become_ready: Callable[[], Awaitable[None]]) -> None:
        """`not_serving` turns readiness off, `become_ready` (tandem/serve.py) back on once
        a set has handshaked and served a warm-up request."""
        engine = self.engine = frontend.engine
        self.frontend = frontend
        self.not_serving = not_serving
        self.become_ready = become_ready
        self.watch = frontend_watch(cfg)
        engine.on_heartbeat = self.watch.seen
        self.served = asyncio.Event()  # the first set served: start-up is over
        self.replacements = 0
        self._broke_at: float | None = None
        self._reason = ""
        self._ready: asyncio.Task[None] | None = None

    def break_set(self, reason: str) -> None:
        """A member reported a failure: replace the set (now, not after its heartbeats
        stop)."""
        self.watch.broken = self.watch.broken or reason

    async def run(self) -> None:
        noted = time.monotonic()
        self._ready = asyncio.create_task(self._serve_when_ready())
        try:
            while True:
                reason = self.watch.lost(self.engine.drained_at)
                if reason:
                    await self._replace(reason)
                elif not self.engine.ready.is_set() and \
                        time.monotonic() - noted > WAITING_NOTE_S:
                    noted = time.monotonic()
                    missing = self.watch.missing()
                    log.info("waiting for the roles to %s", "join: " + ", ".join(missing)
                             if missing else "report ready")
                await asyncio.sleep(POLL_S)
        finally:
            if self._ready is not None:
                self._ready.cancel()
            self.watch.close()

    async def _replace(self, reason: str) -> None:
        self.replacements += 1
        self._broke_at, self._reason = time.monotonic(), reason
        log.warning("%s: failing %d open requests and replacing the set of roles (each "
                    "exits and is restarted by its orchestrator); the frontend keeps running",
                    reason, self.engine.num_in_flight)
        await self.not_serving()
        self.frontend.limits = None  # both APIs answer UNAVAILABLE (HTTP 503) with why
        self.frontend.serving = False
        self.frontend.unready = f"the engine is restarting ({reason}); retry shortly"
        self.engine.reset(f"the engine's roles are being replaced ({reason}); the request "
                          "was lost, retry it")
        self.watch.renew()
        if self._ready is not None:
            self._ready.cancel()
        self._ready = asyncio.create_task(self._serve_when_ready())

    async def _serve_when_ready(self) -> None:
        """Handshake, warm-up, SERVING (the frontend's readiness), for the current set."""
        try:
            await self.become_ready()
        except Exception as exc:  # the set broke during the warm-up: the next one retries
            log.info("the set stopped before it was ready: %s", exc)
            return
        self.served.set()
        if self._broke_at is not None:
            log.warning("serving again, %.1f s after %s", time.monotonic() - self._broke_at,
                        self._reason)
            self._broke_at = None
