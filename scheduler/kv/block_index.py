"""The prefix cache's bookkeeping in memory sized once, for every KV block, at start-up.

The cache may give every KV block a hash: it keeps a prompt block findable until the block
is needed for something else, and blocks go to new work from the free list first, so the
number of hashed blocks only grows until it reaches `num_blocks`.  Under a steady load of
distinct prompts that takes as long as filling every block with prompt blocks does (about
40 minutes in the 60-minute soak: 8,192 blocks, about one new prompt block a request).
Kept in a dict of digests and an OrderedDict, each hashed block cost about 170 bytes of
Python objects (its digest, a dict entry, a linked-list node), so the scheduler's memory
crept up for that long, in steps (pymalloc's 1 MiB arenas, the dict's table doubling).
Here the same bookkeeping lives in arrays of a fixed size allocated with the block manager,
so the scheduler's memory does not depend on how full the cache is:

* `HashIndex`: digest -> block, open addressing with linear probing over a table of at
  least twice as many slots as blocks, each block's digest stored at its own offset;
  removal shifts the rest of a probe run back (no tombstones to clean up);
* `BlockLru`: a set of blocks in the order they joined it, as a doubly linked list threaded
  through two index arrays.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator

DIGEST_SIZE = 16  # bytes of a block hash (`block_manager.hash_block`)
_EMPTY = -1
MAX_BLOCKS = 1 << 30  # block ids and table slots are int32


class HashIndex:
    """Block hashes (DIGEST_SIZE bytes each) -> block ids in [0, num_blocks); one hash per
    block at most."""

    def __init__(self, num_blocks: int) -> None:
        if not 0 < num_blocks < MAX_BLOCKS:
            raise ValueError(f"num_blocks={num_blocks} must lie in [1, {MAX_BLOCKS})")
        size = 1 << max(3, (2 * num_blocks).bit_length())  # load factor below 1/2
        self._mask = size - 1
        self._slots = array("i", [_EMPTY]) * size  # block id, or _EMPTY (ids fit in int32)
        self._digests = bytearray(num_blocks * DIGEST_SIZE)  # block b's at b * DIGEST_SIZE
        self._hashed = bytearray(num_blocks)  # 1: the block holds a hash
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def has(self, block: int) -> bool:
        return bool(self._hashed[block])

    def digest(self, block: int) -> bytes | None:
        if not self._hashed[block]:
            return None
        start = block * DIGEST_SIZE
        return bytes(self._digests[start : start + DIGEST_SIZE])

    def get(self, digest: bytes) -> int | None:
        slot = self._find(digest)
        return None if slot is None else self._slots[slot]

    def add(self, digest: bytes, block: int) -> None:
        """Make `block` findable by `digest`; neither may be in the index yet."""
        if len(digest) != DIGEST_SIZE:
            raise ValueError(f"block hash has {len(digest)} bytes; the index holds "
                             f"{DIGEST_SIZE}-byte hashes")
        if self._hashed[block] or self._find(digest) is not None:
            raise AssertionError(f"block {block} or its hash is already in the index")
        slot = self._home(digest)
        while self._slots[slot] != _EMPTY:
            slot = (slot + 1) & self._mask
        self._slots[slot] = block
        start = block * DIGEST_SIZE
        self._digests[start : start + DIGEST_SIZE] = digest
        self._hashed[block] = 1
        self._len += 1

    def remove(self, block: int) -> None:
        """Forget `block`'s hash (it must have one)."""
        digest = self.digest(block)
        slot = None if digest is None else self._find(digest)
        if slot is None:
            raise AssertionError(f"block {block} has no hash in the index")
        self._hashed[block] = 0
        self._len -= 1
        self._close_gap(slot)

    def clear(self) -> None:
        """Forget every hash (the prefix cache is reset)."""
        self._slots = array("i", [_EMPTY]) * (self._mask + 1)
        self._hashed = bytearray(len(self._hashed))
        self._len = 0

    def items(self) -> Iterator[tuple[bytes, int]]:
        for block in range(len(self._hashed)):
            digest = self.digest(block)
            if digest is not None:
                yield digest, block

    def check_invariants(self) -> None:
        placed = [b for b in self._slots if b != _EMPTY]
        assert len(placed) == len(set(placed)) == self._len, "a block sits in two slots"
        assert sorted(placed) == [b for b, h in enumerate(self._hashed) if h], (
            "hashed blocks and the table disagree")
        for digest, block in self.items():
            assert self.get(digest) == block, f"block {block} is not found by its hash"

    def _home(self, digest: bytes | bytearray) -> int:
        # The digest is uniformly random: its first bytes are as good a hash as any.
        return int.from_bytes(digest[:8], "little") & self._mask

    def _matches(self, block: int, digest: bytes) -> bool:
        start = block * DIGEST_SIZE
        return self._digests[start : start + DIGEST_SIZE] == digest

    def _find(self, digest: bytes) -> int | None:
        slot = self._home(digest)
        while (block := self._slots[slot]) != _EMPTY:
            if self._matches(block, digest):
                return slot
            slot = (slot + 1) & self._mask
        return None

    def _close_gap(self, gap: int) -> None:
        """Empty `gap`, moving back every later entry of its probe run that would otherwise
        no longer be found from its home slot."""
        slot = gap
        while True:
            slot = (slot + 1) & self._mask
            block = self._slots[slot]
            if block == _EMPTY:
                break
            start = block * DIGEST_SIZE
            home = self._home(self._digests[start : start + 8])
            # It stays if its home lies cyclically in (gap, slot]: its run does not cross gap.
            if (slot - home) & self._mask < (slot - gap) & self._mask:
                continue
            self._slots[gap] = block
            gap = slot
        self._slots[gap] = _EMPTY


class BlockLru:
    """A set of block ids in [0, num_blocks), oldest first: add (newest), remove any, pop
    the oldest, each O(1) and without allocating."""

    def __init__(self, num_blocks: int) -> None:
        self._end = num_blocks  # the sentinel: its next is the oldest, its prev the newest
        self._next = array("i", [0]) * (num_blocks + 1)
        self._prev = array("i", [0]) * (num_blocks + 1)
        self._next[self._end] = self._prev[self._end] = self._end
        self._member = bytearray(num_blocks)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return bool(self._member[block])

    def __iter__(self) -> Iterator[int]:
        block = self._next[self._end]
        while block != self._end:
            yield block
            block = self._next[block]

    def add(self, block: int) -> None:
        if self._member[block]:
            raise AssertionError(f"block {block} is already in the LRU list")
        newest = self._prev[self._end]
        self._next[newest], self._prev[block] = block, newest
        self._next[block], self._prev[self._end] = self._end, block
        self._member[block] = 1
        self._len += 1

    def remove(self, block: int) -> None:
        if not self._member[block]:
            raise AssertionError(f"block {block} is not in the LRU list")
        before, after = self._prev[block], self._next[block]
        self._next[before], self._prev[after] = after, before
        self._member[block] = 0
        self._len -= 1

    def pop_oldest(self) -> int:
        block = self._next[self._end]
        if block == self._end:
            raise IndexError("pop from an empty LRU list")
        self.remove(block)
        return block
