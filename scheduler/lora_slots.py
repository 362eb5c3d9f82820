"""Which LoRA adapter sits in which of the gpu worker's adapter slots.

The worker holds `max_loras` adapters at once (slots 1..max_loras; 0 is "no adapter").  A
request takes its adapter's slot when it is admitted and gives it back when it finishes;
a preempted request keeps it while it waits, so resuming never reloads weights and never
fails halfway through a stream.  An adapter no request holds stays loaded (idle) until its
slot is needed: a free slot first (the lowest, so few slots stay in use and eager forwards
compute fewer of them), else the least recently used idle adapter's.  When every slot is
held, a request for another adapter waits at the head of the queue like one waiting for KV
blocks, so no plan ever names more distinct adapters than there are slots.

A load travels in the plan that first needs it (`StepPlan.adapters`) and is applied before
its forwards; plans run in order at the worker, so the adapter it replaces, idle here, is
no longer used by any plan still running.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from tandem_serve.proto.adapter_messages import AdapterLoad


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}  # resident adapters
        self._free: set[int] = set(range(1, max_loras + 1))
        self._users: Counter[str] = Counter()  # requests holding each resident adapter
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unheld: LRU first
        self.num_loads = 0

    @property
    def resident(self) -> list[str]:
        """Adapters loaded at the worker (or about to be, in a plan sent), in slot order."""
        return sorted(self._slot_of, key=self._slot_of.__getitem__)

    def slot_of(self, adapter_id: str) -> int:
        return self._slot_of.get(adapter_id, 0)

    def can_take(self, adapter_id: str) -> bool:
        """Whether a request for `adapter_id` could get a slot now."""
        return (not adapter_id or adapter_id in self._slot_of or bool(self._free)
                or bool(self._idle))

    def take(self, adapter_id: str) -> tuple[int, AdapterLoad | None]:
        """One more holder of `adapter_id`: its slot, and the load to send when it is new."""
        load = None
        slot = self._slot_of.get(adapter_id)
        if slot is None:
            slot = self._vacate()
            self._slot_of[adapter_id] = slot
            load = AdapterLoad(slot, adapter_id)
            self.num_loads += 1
        self._idle.pop(adapter_id, None)
        self._users[adapter_id] += 1
        return slot, load

    def give_back(self, adapter_id: str) -> None:
        self._users[adapter_id] -= 1
        if self._users[adapter_id] <= 0:
            del self._users[adapter_id]
            self._idle[adapter_id] = None  # the most recently used idle adapter

    def forget(self, adapter_id: str, slot: int) -> bool:
        """The worker could not load `adapter_id` into `slot`: free the slot (its holders were
        failed first).  False when the slot has been given to another adapter since."""
        if self._slot_of.get(adapter_id) != slot or self._users[adapter_id] > 0:
            return False
        del self._slot_of[adapter_id]
        self._idle.pop(adapter_id, None)
        self._users.pop(adapter_id, None)
        self._free.add(slot)
        return True

    def _vacate(self) -> int:
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
            return slot
        evicted, _ = self._idle.popitem(last=False)
        return self._slot_of.pop(evicted)

    def check_invariants(self, holders: Counter[str]) -> None:
        """`holders`: adapter -> requests (running or preempted) holding its slot."""
        assert +holders == +self._users, f"slot holders {dict(holders)} != {dict(self._users)}"
        slots = list(self._slot_of.values())
        assert len(set(slots)) == len(slots), "two adapters share a slot"
        assert not self._free & set(slots), "a free slot holds an adapter"
        assert len(self._free) + len(slots) == self.max_loras, "a slot got lost"
        assert set(self._idle) == set(self._slot_of) - set(self._users), "idle list is stale"
