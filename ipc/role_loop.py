"""One runtime for every process role: receive → dispatch by message type → the role's work.

A role (the scheduler, the gpu worker and its other tensor-parallel ranks, a postproc worker)
is the handlers of the messages it serves and the work it does between receives; its
`main.py` hands them to `RoleLoop.run`.  What every role does the same way lives here, once:

- peers: on its own (`tandem run-role`) a role watches the frontend (`ipc.peers.RoleWatch`),
  heartbeats to it, joins its set when listed, says it is ready then (under the launcher: at
  once), and leaves (PeerLost, exit non-zero) when the set is replaced or the frontend is
  silent;
- `Shutdown` ends the loop, once the role has passed it on to any process it leads;
- `ProfileControl` starts and stops the recording and sends the data (`ipc.tracing`);
- injected faults (`ipc.faults`) fire at the plans the role reports (tests only);
- a message of a type the role does not serve is logged, not fatal;
- the inbox, the reply channel and whatever the role gave it to own are closed on any exit.

The shape is vLLM v1's `EngineCoreProc.run_busy_loop` (process the input, then one step of
work, with one dispatcher by message type) and mini-sglang's `SchedulerIOMixin`.  Where
messages come from is pluggable (`Source`): the inbox by default; the postproc worker reads
the token ring after its inbox, a tensor-parallel rank the plan channel from rank 0.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar

from tandem_serve.ipc import faults
from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.ipc.peers import HEARTBEAT_INTERVAL, RoleWatch, peer_name, role_watch
from tandem_serve.ipc.process import freeze_heap
from tandem_serve.ipc.tracing import ProfileExtra, on_profile_control, set_role
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.control_messages import Shutdown
from tandem_serve.proto.monitor_messages import Heartbeat, ProfileControl

Handler = Callable[[Any], None]
# Under the launcher nothing but the role's own idle work needs a timely wake-up.
IDLE_WAIT = 1.0


class Source(Protocol):
    def receive(self) -> Iterable[Any]:
        """The messages that came, in the order to handle them; none when the wait ran out.
        A wait on the frontend's heartbeats must not outlast HEARTBEAT_INTERVAL."""
        ...


class Inbox:
    """A role's inbox as its source: one message per wait, or (`drain`) that message and
    everything already waiting behind it, so that the work after sees all of them."""

    def __init__(self, rx: Receiver[Any], timeout: float, drain: bool = False) -> None:
        self.rx, self.timeout, self.drain = rx, timeout, drain

    def receive(self) -> list[Any]:
        msg = self.rx.get(timeout=self.timeout)
        if msg is None:
            return []
        return [msg, *self.rx.drain()] if self.drain else [msg]


@dataclass
class Announce:
    """What a role sends once it can serve, and to whom: under the launcher at start, on its
    own when it joins the frontend's set (`repeat`: and with every heartbeat of the set after,
    for a receiver that may come up later than we join)."""

    to: Sender[Any]
    msg: object
    about: str  # the log says "ready (<about>)"
    repeat: bool = False


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)
T = TypeVar("T")


class RoleLoop:
    """The runtime of role `role` (number `index` among its kind): a context that closes what
    it owns, and `run`, the loop.  `title` is the process's name in `ps` and in fault specs
    when it differs from its name in the set (`gpu-worker 0/2`); `in_set=False` for a process
    the frontend does not know (a tensor-parallel rank > 0: rank 0 answers for it)."""

    def __init__(self, cfg: ServerConfig, role: str, index: int = 0, *, inbox: Receiver[Any],
                 log: logging.Logger, reply: Sender[Any] | None = None, title: str = "",
                 in_set: bool = True) -> None:
        self.cfg, self.role, self.index = cfg, role, index
        self.name = peer_name(role, index)
        self.title = title or self.name
        self.inbox, self.reply, self.log = inbox, reply, log
        self.in_set = in_set
        self.peers: RoleWatch | None = None
        self._announce: Announce | None = None
        self._on_shutdown: Handler | None = None
        self._stopped = False
        self._closing = ExitStack()
        self._closing.callback(inbox.close)
        if reply is not None:
            self._closing.callback(reply.close)

    def own(self, thing: C) -> C:
        """Close `thing` when the role ends (the last owned first)."""
        self._closing.callback(thing.close)
        return thing

    def enter(self, context: AbstractContextManager[T]) -> T:
        """Own a context manager: its exit sees how the role ended (SIGTERM included)."""
        return self._closing.enter_context(context)

    def __enter__(self) -> RoleLoop:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        return self._closing.__exit__(kind, exc, tb)

    def maybe_fault(self, plan_id: int) -> None:
        """The role reached plan `plan_id`: an injected fault armed for it fires (tests only;
        otherwise one truth test)."""
        faults.maybe_fire(self.title, plan_id)

    def profile(self, msg: ProfileControl, extra: ProfileExtra | None = None) -> None:
        """Start or stop recording; the data goes to the reply channel (the frontend)."""
        if self.reply is None:
            raise RuntimeError(f"{self.title}: no reply channel for its profile data")
        on_profile_control(msg, self.reply, extra)

    def run(self, handlers: Mapping[type, Handler], *, source: Source | None = None,
            ready: Announce | None = None, idle: Callable[[], None] | None = None,
            work: Callable[[], None] | None = None,
            on_shutdown: Handler | None = None) -> None:
        """Serve until a `Shutdown`: `handlers` by message type (they may replace the
        runtime's own for ProfileControl); `idle` after a wait that brought nothing; `work`
        after every receive; `on_shutdown` passes the Shutdown on before the loop ends."""
        self._start(ready)
        self._on_shutdown = on_shutdown
        table: dict[type, Handler] = {Heartbeat: self._heartbeat, Shutdown: self._shutdown}
        if self.reply is not None:
            table[ProfileControl] = self.profile
        table.update(handlers)
        source = source or Inbox(self.inbox, HEARTBEAT_INTERVAL if self.peers else IDLE_WAIT)
        while True:
            if self.peers is not None:  # on its own: lose the frontend, exit non-zero
                self.peers.check(self.inbox.drained_at)
            received = False
            for msg in source.receive():
                received = True
                self._dispatch(table, msg)
                if self._stopped:
                    return
            if not received and idle is not None:
                idle()
            if work is not None:
                work()

    def _start(self, ready: Announce | None) -> None:
        set_role(self.name)
        freeze_heap()  # start-up is done: no full collection walks it again while serving
        self._announce = ready
        watch = role_watch(self.cfg, self.role, self.index) if self.in_set else None
        if watch is not None:  # on our own: ready once in the frontend's set
            self.peers = self.own(watch)
        elif ready is not None:  # under the launcher
            ready.to.put(ready.msg)
            self.log.info("ready (%s)", ready.about)

    def _dispatch(self, table: Mapping[type, Handler], msg: object) -> None:
        handler = table.get(type(msg))
        if handler is None:
            self.log.error("unexpected message %s", type(msg).__name__)
            return
        handler(msg)

    def _heartbeat(self, hb: Heartbeat) -> None:
        if self.peers is None:  # none from the frontend here; rank 0's to its other ranks
            return
        joined = self.peers.seen(hb)
        ready = self._announce
        if ready is None:
            return
        if joined:
            self.log.info("ready (%s), in the set of epoch %x", ready.about, self.peers.epoch)
        if joined or (ready.repeat and self.peers.epoch):
            ready.to.put(ready.msg)

    def _shutdown(self, msg: Shutdown) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown(msg)
        self.log.info("shutting down: %s", msg.reason)
        self._stopped = True
