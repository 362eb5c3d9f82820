"""Heartbeats between roles started on their own (`tandem run-role`, one container each).

Without a launcher that owns the processes, the frontend and every other role watch each
other: each side sends a `Heartbeat` every HEARTBEAT_INTERVAL and treats a peer silent for
PEER_TIMEOUT as dead.  The frontend then fails every request with UNAVAILABLE and exits
non-zero; a role that loses the frontend exits non-zero.  Either way the orchestrator's
restart policy brings the set back.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ipc.channels import Sender
from proto.messages import Heartbeat

if TYPE_CHECKING:
    from proto.config import ServerConfig

HEARTBEAT_INTERVAL = 0.5
PEER_TIMEOUT = 3.0
START_GRACE = 600.0  # a peer may take this long to appear (model load, image pull)


class PeerLost(RuntimeError):
    pass


class PeerWatch:
    """Sends our heartbeats from a thread (so a long plan never looks like a death) and
    tells the main loop, on `check()`, when a peer went silent."""

    def __init__(self, me: Heartbeat, addresses: Sequence[str], expected: Sequence[str],
                 timeout: float = PEER_TIMEOUT) -> None:
        self.me = me
        self.timeout = timeout
        self.started = time.monotonic()
        self.last_seen: dict[str, float] = {}
        self.expected = list(expected)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(list(addresses),),
                                        name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, addresses: list[str]) -> None:
        senders: list[Sender] = [Sender(a) for a in addresses]  # owned by this thread alone
        try:
            while not self._stop.wait(HEARTBEAT_INTERVAL):
                for s in senders:
                    try:
                        s.put(self.me, timeout=0)
                    except TimeoutError:  # not connected yet, or not reading: skip
                        pass
        finally:
            for s in senders:
                s.close()

    def seen(self, msg: Heartbeat) -> None:
        self.last_seen[peer_name(msg.role, msg.index)] = time.monotonic()

    def check(self) -> None:
        lost = self.lost()
        if lost:
            raise PeerLost(lost)

    def lost(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        for name in self.expected:
            seen = self.last_seen.get(name)
            if seen is None and now - self.started > START_GRACE:
                return f"{name} never sent a heartbeat in {START_GRACE:.0f} s"
            if seen is not None and now - seen > self.timeout:
                return f"{name} stopped sending heartbeats ({now - seen:.1f} s ago)"
        return ""

    def close(self) -> None:
        self._stop.set()


def peer_name(role: str, index: int = 0) -> str:
    return f"postproc {index}" if role == "postproc" else role


def role_watch(cfg: ServerConfig, role: str, index: int = 0) -> PeerWatch | None:
    """A role's watch on the frontend, when it runs on its own; None under a launcher."""
    if not cfg.standalone:
        return None
    return PeerWatch(Heartbeat(role, index), [cfg.addresses.frontend_inbox], ["frontend"])


def frontend_watch(cfg: ServerConfig) -> PeerWatch:
    addr = cfg.addresses
    senders = [addr.scheduler_inbox, addr.worker_inbox, *addr.postproc_inboxes]
    expected = ["scheduler", "gpu-worker"] + [f"postproc {i}"
                                             for i in range(len(addr.postproc_inboxes))]
    return PeerWatch(Heartbeat("frontend"), senders, expected)
