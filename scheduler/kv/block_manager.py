"""KV cache block accounting with automatic prefix caching.

Every block is in exactly one of three places:

* free: holds nothing anyone can ask for; handed out first;
* evictable: holds a registered prompt block that no request uses (refcount 0).  It stays
  findable by its hash, in LRU order, and is reused for something else only when no free
  block is left;
* used: refcount > 0, one reference per request holding it.  Only registered blocks are
  ever shared, and nobody writes into a shared block (holders take it as computed).

A block's hash is chained over its tokens and the previous block's hash, so the same
tokens under a different prefix never match; a prompt run under a LoRA adapter starts its
chain from a hash of the adapter's id, so its KV is never shared with another adapter's.
"""
from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tandem_serve.proto.request_params import ImageInput
from tandem_serve.scheduler.kv.block_index import DIGEST_SIZE, BlockLru, HashIndex

BlockHash = bytes


def hash_block(prev: BlockHash | None, tokens: np.ndarray) -> BlockHash:
    # A cryptographic digest keeps a collision (= silently wrong KV) out of reach even for
    # prompts crafted to collide, which Python's tuple hash would not.
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
    digest.update(prev or b"")
    digest.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return digest.digest()


def adapter_salt(adapter_id: str) -> BlockHash | None:
    """Where the hash chain of a prompt run under `adapter_id` starts (None: the base model).

    A digest like the chain's own links, so no adapter id can pose as a prefix of tokens.
    """
    if not adapter_id:
        return None
    return hashlib.blake2b(b"lora-adapter\0" + adapter_id.encode(),
                           digest_size=DIGEST_SIZE).digest()


def prompt_block_hashes(prompt_ids: np.ndarray, block_size: int,
                        salt: BlockHash | None = None,
                        images: Sequence[ImageInput] = ()) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks (a partial last block is never shared),
    the chain started from `salt` (see `adapter_salt`).  A block holding any of an image's
    placeholder tokens also hashes that image's digest: the placeholders are the same ids
    for every image, their KV is not."""
    hashes: list[BlockHash] = []
    prev: BlockHash | None = salt
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        end = start + block_size
        seen = [im.digest for im in images if im.offset < end and im.offset + im.length > start]
        prev = hash_block(prev, prompt_ids[start:end])
        if seen:
            prev = hashlib.blake2b(prev + b"".join(seen), digest_size=DIGEST_SIZE).digest()
        hashes.append(prev)
    return hashes


class CacheObserver(Protocol):
    """Told what leaves the device cache (`scheduler/kv/host_tier.py`: the host tier and the
    published events)."""

    def evicted(self, block: int, block_hash: BlockHash) -> None:
        """`block`, holding `block_hash`, is about to be reused for something else."""

    def cleared(self) -> None:
        """Every hash was forgotten."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Sized for every block at once: filling the cache allocates nothing (block_index).
        self._evictable = BlockLru(num_blocks)  # oldest first
        self._cached = HashIndex(num_blocks)
        self.observer: CacheObserver | None = None

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prompt block, in use or evictable."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def is_cached(self, block: int) -> bool:
        return self._cached.has(block)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The longest chain of cached blocks matching `hashes` from the start; no side effects."""
        if not self.enable_caching:
            return []
        found: list[int] = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free pool: taking them shrinks `num_free`."""
        return sum(1 for block in blocks if self._refcount[block] == 0)

    # ------------------------------------------------------------------ changes

    def take(self, blocks: Sequence[int]) -> None:
        """Share cached blocks found by `lookup` with one more holder."""
        for block in blocks:
            if not self._cached.has(block):
                raise AssertionError(f"block {block} is not cached and cannot be shared")
            if self._refcount[block] == 0:
                self._evictable.remove(block)
            self._refcount[block] += 1

    def allocate(self, num: int) -> list[int]:
        if num > self.num_free:
            raise AssertionError(f"allocate({num}) with only {self.num_free} blocks free")
        return [self._pop_free() for _ in range(num)]

    def free(self, blocks: Sequence[int]) -> None:
        # Tail blocks go back first so that they are evicted before the prefix they extend:
        # a cached tail is useless without its head.
        for block in reversed(blocks):
            if self._refcount[block] <= 0:
                raise AssertionError(f"block {block} freed more often than it was handed out")
            self._refcount[block] -= 1
            if self._refcount[block] > 0:
                continue
            if self._cached.has(block):
                self._evictable.add(block)
            else:
                self._free.append(block)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Make a filled prompt block findable; False if the cache already has that content."""
        if not self.enable_caching or self._cached.get(block_hash) is not None:
            return False
        if self._refcount[block] <= 0 or self._cached.has(block):
            raise AssertionError(f"block {block} cannot be registered (refcount "
                                 f"{self._refcount[block]}, cached {self.is_cached(block)})")
        self._cached.add(block_hash, block)
        return True

    def clear(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache; new weights, or KV freed by
        sleep, make the old KV wrong): evictable blocks become free, blocks in use keep their
        KV but can no longer be found; the observer is told. Returns how many blocks had a
        hash."""
        hashed = sum(1 for b in range(self.num_blocks) if self._cached.has(b))
        while self._evictable:
            self._free.append(self._evictable.pop_oldest())
        self._cached.clear()
        if self.observer is not None:
            self.observer.cleared()
        return hashed

    def _pop_free(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block = self._evictable.pop_oldest()
            if self.observer is not None:
                digest = self._cached.digest(block)
                assert digest is not None
                self.observer.evicted(block, digest)
            self._cached.remove(block)
        self._refcount[block] = 1
        return block

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        used = {b for b in range(self.num_blocks) if self._refcount[b] > 0}
        assert not used & (free | evictable), "a used block sits in the free pool"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "a block got lost"
        assert all(rc >= 0 for rc in self._refcount), "negative refcount"
        assert len(evictable) == len(self._evictable), "the LRU list is inconsistent"
        for block in free:
            assert not self._cached.has(block), f"free block {block} still has a hash"
        for block in evictable:
            assert self._cached.has(block), f"evictable block {block} has no hash"
        self._cached.check_invariants()
