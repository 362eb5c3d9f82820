"""Compiled constraints on their way to the scheduler: each table crosses once per id.

A guided request names its constraint by content id (`SamplingParams.guided_id`) and carries
nothing else of it, so an `AddRequest` stays a few hundred bytes where a JSON schema's table
is most of a megabyte.  The table goes to the scheduler as a message of its own
(`GuidedTable` / `GuidedGrammar`) on the same channel, just before the first request that
names it, so it is there first; the scheduler passes it to the gpu worker once
(`StepPlan.tables`).

What the frontend remembers as sent is only a hint: the scheduler may have let its copy go
once no request named it, and the worker may have dropped the table since, or the roles
behind us may have been replaced.  So the scheduler asks for what it lacks (`GuidedWanted`),
and the frontend answers from the constraints its open streams use, which stay pinned here
while they are open (no recompile, whatever the compile cache evicted).  A constraint that no
open stream uses is answered `GuidedLost`: its requests are gone or going (their aborts went
first on the same channel), and the scheduler fails whatever still names it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tandem_serve.frontend import metrics
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedLost, GuidedTable, GuidedWanted

Compiled = GuidedTable | GuidedGrammar

SENT_KEPT = 4096  # ids remembered as sent; one forgotten costs a redundant send, no more


def compiled_id(item: Compiled) -> str:
    return item.table_id if isinstance(item, GuidedTable) else item.grammar_id


@dataclass
class _Pin:
    item: Compiled
    streams: int = 0


class ConstraintSender:
    """The constraints open streams use, and which ids the scheduler was sent."""

    def __init__(self, put: Callable[[object], None], sent_kept: int = SENT_KEPT) -> None:
        self._put = put
        self._sent_kept = sent_kept
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._pinned: dict[str, _Pin] = {}

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def open(self, item: Compiled) -> None:
        """A stream using `item` opens: keep it until `close`, and send it unless sent."""
        gid = compiled_id(item)
        pin = self._pinned.setdefault(gid, _Pin(item))
        pin.streams += 1
        if gid in self._sent:
            self._sent.move_to_end(gid)
        else:
            self._send(item, "first")

    def close(self, item: Compiled) -> None:
        gid = compiled_id(item)
        pin = self._pinned[gid]
        pin.streams -= 1
        if pin.streams == 0:
            del self._pinned[gid]

    def on_wanted(self, msg: GuidedWanted) -> None:
        for gid in msg.guided_ids:
            pin = self._pinned.get(gid)
            if pin is not None:
                self._send(pin.item, "asked")
            else:
                self._sent.pop(gid, None)
                self._put(GuidedLost(gid, f"guided constraint {gid[:12]} is no longer held: "
                                          "no open request of this frontend uses it"))

    def reset(self) -> None:
        """The roles behind us were replaced: the new scheduler has been sent nothing."""
        self._sent.clear()

    def _send(self, item: Compiled, why: str) -> None:
        self._put(item)
        self._sent[compiled_id(item)] = None
        while len(self._sent) > self._sent_kept:
            self._sent.popitem(last=False)
        metrics.GUIDED_SENT.labels(why).inc()
