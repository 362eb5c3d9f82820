"""Heartbeats and sets between roles started on their own (`tandem run-role`, one container
each, as compose runs them).

Without a launcher that owns the processes, the frontend and every other role watch each
other: each sends a `Heartbeat` every HEARTBEAT_INTERVAL, and a peer silent for PEER_TIMEOUT
is dead.  Each process has a random *incarnation*, so a role that compose restarted faster
than PEER_TIMEOUT is still seen as a new process, not mistaken for the old one.

The scheduler, gpu worker and postproc workers hold state that is only consistent together
(KV blocks, plans in flight, detokenizer state), so they serve as a *set*: the frontend
admits fresh processes (epoch 0) into its set, named by a random *epoch*, and lists their
incarnations in its heartbeats; a process joins when it sees itself listed
(`ipc.channels.set_epoch`: from then on it stamps its messages with the epoch and keeps only
the set's).  When a member dies or restarts, the frontend fails what is in flight, starts a
new epoch with the members that had not joined yet, and keeps serving gRPC (NOT_SERVING until
the new set is ready).  Every process of the old set sees that it is no longer listed and
exits non-zero, and compose's restart policy starts it again, fresh; a frontend that
restarts makes every role exit the same way.  Only the frontend survives a break: it holds
no state of the set.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem_serve.ipc.channels import Sender, set_epoch
from tandem_serve.proto.monitor_messages import Heartbeat

if TYPE_CHECKING:
    from tandem_serve.proto.config import ServerConfig

HEARTBEAT_INTERVAL = 0.5
PEER_TIMEOUT = 3.0
START_GRACE = 600.0  # a frontend may take this long to appear (image pull, slow start)


class PeerLost(RuntimeError):
    """This role must exit (non-zero) so its orchestrator starts it again, fresh."""


def new_id() -> int:
    """A random nonzero 63-bit id (incarnations and epochs)."""
    return secrets.randbits(63) or 1


def peer_name(role: str, index: int = 0) -> str:
    return f"postproc {index}" if role == "postproc" else role


class Beacon:
    """Sends our heartbeat to every address from a thread (so a long plan never looks like a
    death); `update` changes what it says and sends it at once."""

    def __init__(self, me: Heartbeat, addresses: Sequence[str]) -> None:
        self.me = me
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._beat, args=(list(addresses),),
                                        name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, addresses: list[str]) -> None:
        senders: list[Sender] = [Sender(a) for a in addresses]  # owned by this thread alone
        try:
            while not self._stop:
                for s in senders:
                    try:
                        s.put(self.me, timeout=0)
                    except TimeoutError:  # not connected yet, or not reading: skip
                        pass
                self._wake.wait(HEARTBEAT_INTERVAL)
                self._wake.clear()
        finally:
            for s in senders:
                s.close()

    def update(self, me: Heartbeat) -> None:
        self.me = me
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()


class RoleWatch:
    """A role's watch on the frontend: join its set when listed, leave (PeerLost) when the
    set is replaced, the frontend is replaced, or it goes silent."""

    def __init__(self, role: str, index: int, frontend_addr: str,
                 timeout: float = PEER_TIMEOUT) -> None:
        self.role, self.index = role, index
        self.name = peer_name(role, index)
        self.incarnation = new_id()
        self.epoch = 0  # the set we joined
        self.frontend = 0  # the incarnation of the frontend whose set it is
        self.timeout = timeout
        self.started = time.monotonic()
        self.last_seen: float | None = None
        self.beacon = Beacon(Heartbeat(role, index, self.incarnation), [frontend_addr])

    def seen(self, hb: Heartbeat) -> bool:
        """A heartbeat came; True when it made this role join the frontend's set."""
        if hb.role != "frontend":
            return False
        self.last_seen = time.monotonic()
        listed = self.incarnation in hb.members
        if self.epoch == 0:
            if not listed:
                return False  # not admitted (yet)
            self.epoch, self.frontend = hb.epoch, hb.incarnation
            set_epoch(hb.epoch)
            self.beacon.update(Heartbeat(self.role, self.index, self.incarnation, hb.epoch))
            return True
        if hb.incarnation != self.frontend:
            raise PeerLost(f"{self.name}: a new frontend took over from the one whose set this "
                           "process served; exiting so that it restarts fresh")
        if hb.epoch != self.epoch or not listed:
            raise PeerLost(f"{self.name}: the frontend replaced the set of roles this process "
                           "served (one of them died or restarted); exiting so that it "
                           "restarts fresh")
        return False

    def check(self, drained_at: float | None = None) -> None:
        """PeerLost when the frontend is gone.  `drained_at`: when our inbox was last read to
        its end; silence counts only up to then, so a process that was busy (a long plan)
        and has heartbeats waiting does not take itself for abandoned."""
        now = time.monotonic() if drained_at is None else drained_at
        if self.last_seen is None:
            if now - self.started > START_GRACE:
                raise PeerLost(f"{self.name}: the frontend never sent a heartbeat in "
                               f"{START_GRACE:.0f} s")
        elif now - self.last_seen > self.timeout:
            raise PeerLost(f"{self.name}: the frontend stopped sending heartbeats "
                           f"({now - self.last_seen:.1f} s ago)")

    def close(self) -> None:
        self.beacon.close()


@dataclass
class Member:
    incarnation: int
    last_seen: float
    joined: bool = False  # its heartbeat carries our epoch


class SetWatch:
    """The frontend's side: admit fresh roles into the set, notice when a member dies or
    restarts (`lost`), and replace the set (`renew`)."""

    def __init__(self, addresses: Sequence[str], expected: Sequence[str],
                 timeout: float = PEER_TIMEOUT) -> None:
        self.expected = list(expected)
        self.timeout = timeout
        self.incarnation = new_id()
        self.epoch = 0
        self.members: dict[str, Member] = {}
        self.fresh: dict[str, int] = {}  # restarted processes waiting for the next set
        self.retired: set[int] = set()  # processes of replaced sets: never admitted again
        self.broken = ""
        self.beacon = Beacon(Heartbeat("frontend", 0, self.incarnation), addresses)
        self.renew()

    def seen(self, hb: Heartbeat) -> None:
        name = peer_name(hb.role, hb.index)
        if name not in self.expected or hb.incarnation in self.retired:
            return  # a process of a replaced set, on its way out
        now = time.monotonic()
        m = self.members.get(name)
        if m is None:
            if hb.epoch == 0:  # fresh: admit it (a process of another set leaves by itself)
                self.members[name] = Member(hb.incarnation, now)
                self._publish()
            return
        if m.incarnation != hb.incarnation:
            if hb.epoch == 0:  # a new process under a member's name: the member restarted
                self.fresh[name] = hb.incarnation
                self.broken = self.broken or f"{name} restarted"
            return
        m.last_seen = now
        m.joined = m.joined or hb.epoch == self.epoch

    def lost(self, drained_at: float | None = None) -> str:
        """Why the set can no longer serve ("" while it can).  `drained_at` as in
        `RoleWatch.check`: a member is silent only if nothing of it waits in our inbox."""
        if self.broken:
            return self.broken
        now = time.monotonic() if drained_at is None else drained_at
        for name, m in self.members.items():
            if now - m.last_seen > self.timeout:
                return f"{name} stopped sending heartbeats ({now - m.last_seen:.1f} s ago)"
        return ""

    def missing(self) -> list[str]:
        """Roles with no member in the set yet."""
        return [n for n in self.expected if n not in self.members]

    def renew(self) -> None:
        """A new epoch: members that joined the old set leave; admitted ones that had not
        joined yet, and restarted processes, carry over."""
        now = time.monotonic()
        self.retired |= {m.incarnation for m in self.members.values() if m.joined}
        keep = {n: m for n, m in self.members.items()
                if not m.joined and now - m.last_seen <= self.timeout}
        keep |= {n: Member(inc, now) for n, inc in self.fresh.items()}
        self.members, self.fresh, self.broken = keep, {}, ""
        self.epoch = new_id()
        set_epoch(self.epoch)
        self._publish()

    def _publish(self) -> None:
        self.beacon.update(Heartbeat("frontend", 0, self.incarnation, self.epoch,
                                     sorted(m.incarnation for m in self.members.values())))

    def close(self) -> None:
        self.beacon.close()


def role_watch(cfg: ServerConfig, role: str, index: int = 0) -> RoleWatch | None:
    """A role's watch on the frontend, when it runs on its own; None under a launcher."""
    if not cfg.standalone:
        return None
    return RoleWatch(role, index, cfg.addresses.frontend_inbox)


def frontend_watch(cfg: ServerConfig) -> SetWatch:
    addr = cfg.addresses
    senders = [addr.scheduler_inbox, addr.worker_inbox, *addr.postproc_inboxes]
    expected = ["scheduler", "gpu-worker"] + [f"postproc {i}"
                                             for i in range(len(addr.postproc_inboxes))]
    return SetWatch(senders, expected)
