"""The host KV tier's bookkeeping and the record of the prefix cache's changes.

The gpu worker holds the tier's memory (`gpu_worker/attention/kv_offload.py`: host slots
beside the device cache, on every tensor-parallel rank); the scheduler decides every copy,
so the tier's index lives here, beside the device cache's:

* A device block that leaves the prefix cache (the block manager reuses an evictable block,
  `CacheObserver.evicted`) is copied to a host slot, indexed by the same block hash.  The
  copy is named in the plan being built and runs at that plan's start, before its forwards:
  earlier plans wrote the block (it was full and registered), this plan may overwrite it.
* A request whose prompt continues past its device-cache hits with host hits gets fresh
  device blocks for them, and the plan copies the host slots in before its forwards; the
  request takes those tokens as computed.  Its slots are pinned while the plan is built,
  so no eviction in the same plan reuses them; later plans' offloads run after this plan's
  onloads (plans run in order; on CUDA the worker orders its copy stream after the plan's).
* Host slots are reused least recently used first (a hit counts as a use).

`KvTier` also records, when asked, what a subscriber of vLLM's KV events must see (the
scheduler publishes it, `scheduler/kv/events.py`): blocks stored on the device ("GPU")
as the scheduler registers them, removed as they are evicted, stored on and removed from
the host ("CPU"), and everything cleared.
"""
from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem_serve.scheduler.kv.block_index import BlockLru, HashIndex
from tandem_serve.scheduler.kv.block_manager import BlockHash

GPU, CPU = "GPU", "CPU"  # vLLM's media names (the device tier is "GPU" whatever the device)


@dataclass(frozen=True)
class Stored:
    """Blocks stored on one medium: chained hashes, the first one's parent, their tokens."""

    hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    adapter_id: str
    medium: str


@dataclass(frozen=True)
class Removed:
    hashes: list[BlockHash]
    medium: str


@dataclass(frozen=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@dataclass
class Copies:
    """The copies a plan runs first: offloads (device -> host), then onloads."""

    offload_blocks: list[int] = field(default_factory=list)
    offload_slots: list[int] = field(default_factory=list)
    onload_slots: list[int] = field(default_factory=list)
    onload_blocks: list[int] = field(default_factory=list)


def lora_int_id(adapter_id: str) -> int | None:
    """vLLM's integer LoRA id for an adapter name: a stable 31-bit digest (None: the base)."""
    if not adapter_id:
        return None
    digest = hashlib.blake2b(adapter_id.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF or 1


class _BlockMeta:
    """What a stored event says about each block (kept only when events are recorded):
    its tokens, its parent's hash and its adapter, for `count` blocks or slots."""

    def __init__(self, count: int, block_size: int) -> None:
        self.tokens = np.zeros((count, block_size), dtype=np.int32)
        self.parents: list[BlockHash | None] = [None] * count
        self.adapters: list[str] = [""] * count

    def copy_to(self, other: _BlockMeta, source: int, target: int) -> None:
        other.tokens[target] = self.tokens[source]
        other.parents[target] = self.parents[source]
        other.adapters[target] = self.adapters[source]


class KvTier:
    """The host tier's index and the plan's copies (`num_host_blocks` 0: no tier), and the
    event record (`record_events`)."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 record_events: bool = False) -> None:
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.record_events = record_events
        self._index = HashIndex(num_host_blocks) if num_host_blocks else None
        self._lru = BlockLru(num_host_blocks) if num_host_blocks else None  # unpinned, oldest first
        self._free: deque[int] = deque(range(num_host_blocks))
        self._pinned: dict[int, int] = {}  # slot -> holders in the plan being built
        self._copies = Copies()
        self._events: list[KvEvent] = []
        self._device_meta = _BlockMeta(num_blocks, block_size) if record_events else None
        self._host_meta = (_BlockMeta(num_host_blocks, block_size)
                           if record_events and num_host_blocks else None)
        self.query_tokens = 0  # vLLM's external_prefix_cache_queries (tokens)
        self.hit_tokens = 0  # ... and hits: tokens served from the host tier

    @property
    def active(self) -> bool:
        return self._index is not None or self.record_events

    @property
    def num_used(self) -> int:
        return len(self._index) if self._index is not None else 0

    # ------------------------------------------------------------------ admission

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The host slots of the longest run of `hashes` the tier holds; no side effects."""
        found: list[int] = []
        if self._index is None:
            return found
        for block_hash in hashes:
            slot = self._index.get(block_hash)
            if slot is None:
                break
            found.append(slot)
        return found

    def onload(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """The plan copies `slots` (pinned) into the fresh device `blocks` before its
        forwards."""
        for slot, block in zip(slots, blocks, strict=True):
            assert slot in self._pinned, f"host slot {slot} is onloaded without a pin"
            self._copies.onload_slots.append(slot)
            self._copies.onload_blocks.append(block)

    def count_query(self, num_tokens: int, num_hit_blocks: int) -> None:
        if self._index is not None:
            self.query_tokens += num_tokens
            self.hit_tokens += num_hit_blocks * self.block_size

    def pin(self, slots: Sequence[int]) -> None:
        """Keep `slots` from reuse until the plan is built (before allocating blocks that
        may evict, and offload, others)."""
        for slot in slots:
            self._pin(slot)

    def _pin(self, slot: int) -> None:
        assert self._lru is not None
        if slot not in self._pinned:
            self._lru.remove(slot)
        self._pinned[slot] = self._pinned.get(slot, 0) + 1

    def _unpin(self, slot: int) -> None:
        assert self._lru is not None and self._index is not None
        self._pinned[slot] -= 1
        if self._pinned[slot] == 0:
            del self._pinned[slot]
            if self._index.has(slot):
                self._lru.add(slot)  # the newest: a hit is a use
            else:  # the cache was cleared while it was pinned
                self._free.append(slot)

    # ------------------------------------------------------------------ the device cache

    def device_stored(self, blocks: Sequence[int], hashes: Sequence[BlockHash],
                      parent: BlockHash | None, tokens: np.ndarray, adapter_id: str) -> None:
        """Consecutive prompt blocks were registered in the device cache."""
        if not self.record_events or not blocks:
            return
        meta = self._device_meta
        assert meta is not None
        prev = parent
        for i, block in enumerate(blocks):
            meta.tokens[block] = tokens[i * self.block_size : (i + 1) * self.block_size]
            meta.parents[block], meta.adapters[block] = prev, adapter_id
            prev = hashes[i]
        self._events.append(Stored(list(hashes), parent, tokens.tolist(), adapter_id, GPU))

    def evicted(self, block: int, block_hash: BlockHash) -> None:
        """`block` leaves the device cache: to the host tier, unless it is there already."""
        if self.record_events:
            self._events.append(Removed([block_hash], GPU))
        if self._index is None or self._lru is None:
            return
        slot = self._index.get(block_hash)
        if slot is not None:
            if slot not in self._pinned:  # the same content again: a use
                self._lru.remove(slot)
                self._lru.add(slot)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is pinned by this plan's onloads
        self._index.add(block_hash, slot)
        self._lru.add(slot)
        self._copies.offload_blocks.append(block)
        self._copies.offload_slots.append(slot)
        if self._device_meta is not None and self._host_meta is not None:
            self._device_meta.copy_to(self._host_meta, block, slot)
            meta = self._host_meta
            self._events.append(Stored([block_hash], meta.parents[slot],
                                       meta.tokens[slot].tolist(), meta.adapters[slot], CPU))

    def _take_slot(self) -> int | None:
        assert self._index is not None and self._lru is not None
        if self._free:
            return self._free.popleft()
        if not self._lru:
            return None
        slot = self._lru.pop_oldest()
        old = self._index.digest(slot)
        assert old is not None
        self._index.remove(slot)
        if self.record_events:
            self._events.append(Removed([old], CPU))
        return slot

    def cleared(self) -> None:
        """The prefix cache was reset: the host tier forgets its blocks too (the reason is
        usually new weights, which make every stored block stale)."""
        if self._index is not None and self._lru is not None:
            self._index.clear()
            while self._lru:  # pinned slots stay pinned: this plan's onloads still read them
                self._free.append(self._lru.pop_oldest())
        if self.record_events:
            self._events.append(Cleared())

    # ------------------------------------------------------------------ per plan

    def take_copies(self) -> Copies:
        """The plan's copies; its pinned slots are free to reuse from the next plan on."""
        copies, self._copies = self._copies, Copies()
        for slot in list(self._pinned):
            self._pinned[slot] = 1
            self._unpin(slot)
        return copies

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        if self._index is None or self._lru is None:
            return
        assert not self._pinned, "host slots still pinned between plans"
        assert len(self._index) == len(self._lru), "the host LRU and index disagree"
        assert len(self._index) + len(self._free) == self.num_host_blocks, "host slots leaked"
        self._index.check_invariants()
