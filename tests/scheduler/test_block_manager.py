"""Block manager: allocation, refcounts, chained prefix hashes, LRU eviction."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tandem_serve.scheduler.kv.block_manager import BlockManager, hash_block, prompt_block_hashes

BS = 4


def tokens(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_allocate_and_free_restore_the_free_count() -> None:
    bm = BlockManager(8, BS)
    first = bm.allocate(3)
    second = bm.allocate(5)
    assert len(set(first + second)) == 8
    assert bm.num_free == 0
    with pytest.raises(AssertionError):
        bm.allocate(1)
    bm.free(first)
    bm.free(second)
    assert bm.num_free == 8
    bm.check_invariants()


def test_double_free_is_caught() -> None:
    bm = BlockManager(2, BS)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(AssertionError):
        bm.free(blocks)


def test_shared_block_stays_used_until_its_last_holder_frees_it() -> None:
    bm = BlockManager(4, BS)
    hashes = prompt_block_hashes(tokens(1, 2, 3, 4, 5), BS)
    [block] = bm.allocate(1)
    assert bm.register(block, hashes[0])
    found = bm.lookup(hashes)
    assert found == [block]
    bm.take(found)
    assert bm.refcount(block) == 2
    bm.free([block])
    assert bm.refcount(block) == 1 and bm.num_free == 3
    bm.free([block])
    assert bm.refcount(block) == 0 and bm.num_free == 4
    assert bm.lookup(hashes) == [block], "a freed cached block stays findable"
    bm.check_invariants()


def test_unregistered_blocks_cannot_be_shared() -> None:
    bm = BlockManager(2, BS)
    blocks = bm.allocate(1)
    with pytest.raises(AssertionError):
        bm.take(blocks)


def test_hashes_are_chained_over_the_prefix() -> None:
    a = prompt_block_hashes(tokens(1, 2, 3, 4, 9, 9, 9, 9), BS)
    b = prompt_block_hashes(tokens(5, 6, 7, 8, 9, 9, 9, 9), BS)
    assert len(a) == len(b) == 2
    assert a[1] != b[1], "the same block content under another prefix must not match"
    assert hash_block(None, tokens(9, 9, 9, 9)) not in (a[1], b[1])
    assert prompt_block_hashes(tokens(1, 2, 3), BS) == [], "a partial block is never hashed"

    bm = BlockManager(4, BS)
    blocks = bm.allocate(2)
    for block, block_hash in zip(blocks, a, strict=False):
        bm.register(block, block_hash)
    assert bm.lookup(b) == []
    assert bm.lookup(a) == blocks
    assert bm.lookup([a[0], b[1]]) == blocks[:1], "lookup stops at the first miss"


def test_registering_known_content_twice_keeps_the_first_block() -> None:
    bm = BlockManager(4, BS)
    block_hash = prompt_block_hashes(tokens(1, 2, 3, 4), BS)[0]
    first, second = bm.allocate(2)
    assert bm.register(first, block_hash)
    assert not bm.register(second, block_hash)
    bm.free([first, second])
    assert bm.num_cached == 1
    bm.check_invariants()


def test_plain_free_blocks_go_before_cached_ones_and_eviction_is_lru() -> None:
    bm = BlockManager(4, BS)
    hashes = prompt_block_hashes(tokens(*range(12)), BS)
    cached = bm.allocate(3)
    for block, block_hash in zip(cached, hashes, strict=False):
        bm.register(block, block_hash)
    bm.free(cached)  # freed tail first: the tail is the least recently used
    assert bm.num_cached == 3 and bm.num_free == 4

    [plain] = bm.allocate(1)
    assert plain not in cached, "a plain free block is used before evicting a cached one"
    assert bm.lookup(hashes) == cached

    [evicted] = bm.allocate(1)
    assert evicted == cached[2], "the tail block of the prefix is evicted first"
    assert bm.lookup(hashes) == cached[:2]
    bm.check_invariants()


def test_taking_a_cached_block_refreshes_its_lru_position() -> None:
    bm = BlockManager(2, BS)
    h1 = hash_block(None, tokens(1, 1, 1, 1))
    h2 = hash_block(None, tokens(2, 2, 2, 2))
    b1, b2 = bm.allocate(2)
    bm.register(b1, h1)
    bm.register(b2, h2)
    bm.free([b1])
    bm.free([b2])  # LRU order now: b1 (older), b2
    bm.take([b1])
    bm.free([b1])  # b1 used again: now b2 is the older one
    assert bm.allocate(1) == [b2]
    assert bm.lookup([h1]) == [b1] and bm.lookup([h2]) == []
    bm.check_invariants()


def test_caching_disabled_never_finds_or_registers() -> None:
    bm = BlockManager(2, BS, enable_caching=False)
    block_hash = hash_block(None, tokens(1, 2, 3, 4))
    blocks = bm.allocate(1)
    assert not bm.register(blocks[0], block_hash)
    assert bm.lookup([block_hash]) == []


def test_random_operations_never_hand_out_a_block_twice() -> None:
    rng = random.Random(7)
    bm = BlockManager(16, BS)
    held: list[list[int]] = []  # one list per holder, like requests
    prefixes = [tokens(*[rng.randrange(5) for _ in range(4 * 4)]) for _ in range(3)]
    for _ in range(3000):
        action = rng.random()
        if action < 0.4 and held:
            bm.free(held.pop(rng.randrange(len(held))))
        elif action < 0.7:
            hashes = prompt_block_hashes(prefixes[rng.randrange(3)], BS)
            hits = bm.lookup(hashes)
            num_new = rng.randrange(1, 4)
            if num_new > bm.num_free - bm.num_evictable(hits):
                continue
            bm.take(hits)
            blocks = hits + bm.allocate(num_new)
            for index in range(len(hits), min(len(blocks), len(hashes))):
                bm.register(blocks[index], hashes[index])
            held.append(blocks)
        else:
            num = rng.randrange(1, 4)
            if num <= bm.num_free:
                held.append(bm.allocate(num))
        bm.check_invariants()
        counts: dict[int, int] = {}
        for blocks in held:
            assert len(set(blocks)) == len(blocks)
            for block in blocks:
                counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():
            assert bm.refcount(block) == count
            assert count == 1 or bm.is_cached(block), "only cached blocks are shared"
        assert bm.num_free + len(counts) == 16
    for blocks in held:
        bm.free(blocks)
    assert bm.num_free == 16
    bm.check_invariants()
