"""The prefix cache's fixed-size bookkeeping: the hash index and the LRU list against plain
Python models, and the block manager's memory while the cache fills (the soak's creep)."""
from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict

import numpy as np
import pytest

from tandem_serve.scheduler.kv.block_index import BlockLru, HashIndex
from tandem_serve.scheduler.kv.block_manager import BlockManager, hash_block


def digest(rng: random.Random) -> bytes:
    return rng.randbytes(16)


def test_hash_index_matches_a_dict_through_adds_and_removes() -> None:
    rng = random.Random(0)
    n = 200
    index, model = HashIndex(n), {}
    # Few distinct home slots: long probe runs that wrap around, so removal must shift.
    homes = [rng.randbytes(8) for _ in range(6)]
    for step in range(5000):
        free = [b for b in range(n) if b not in model.values()]
        if free and (not model or rng.random() < 0.55):
            block, key = rng.choice(free), rng.choice(homes) + rng.randbytes(8)
            if key in model:
                continue
            index.add(key, block)
            model[key] = block
        else:
            key = rng.choice(list(model))
            index.remove(model.pop(key))
            assert index.get(key) is None
        assert len(index) == len(model)
        if step % 8 == 0:  # every entry still found (a whole sweep each step is slow)
            for k, b in model.items():
                assert index.get(k) == b and index.digest(b) == k
    index.check_invariants()
    assert dict(index.items()) == model


def test_hash_index_refuses_a_second_hash_and_a_wrong_size() -> None:
    index = HashIndex(4)
    index.add(b"a" * 16, 1)
    with pytest.raises(AssertionError):
        index.add(b"b" * 16, 1)
    with pytest.raises(AssertionError):
        index.add(b"a" * 16, 2)
    with pytest.raises(ValueError, match="16-byte"):
        index.add(b"short", 2)
    with pytest.raises(AssertionError):
        index.remove(3)


def test_block_lru_matches_an_ordered_dict() -> None:
    rng = random.Random(1)
    n = 50
    lru, model = BlockLru(n), OrderedDict[int, None]()
    for _ in range(3000):
        roll = rng.random()
        if roll < 0.45:
            block = rng.randrange(n)
            if block not in model:
                lru.add(block)
                model[block] = None
        elif roll < 0.75 and model:
            block = rng.choice(list(model))
            lru.remove(block)
            del model[block]
        elif model:
            assert lru.pop_oldest() == model.popitem(last=False)[0]
        assert list(lru) == list(model) and len(lru) == len(model)
        assert all((b in lru) == (b in model) for b in range(n))
    with pytest.raises(IndexError):
        BlockLru(3).pop_oldest()


def cycle_every_block(bm: BlockManager, round_: int) -> None:
    """Give every block a new distinct prompt hash, as a load of distinct prompts does."""
    for _ in range(bm.num_blocks // 64):
        blocks = bm.allocate(64)
        for block in blocks:
            bm.register(block, hash_block(None, np.array([round_, block], dtype=np.int32)))
        bm.free(blocks)


def test_filling_the_prefix_cache_allocates_nothing_per_block() -> None:
    """Hashing every block of a fresh cache once, then again (evictions), leaves the block
    manager's memory where it started: it is sized for a full cache up front."""
    bm = BlockManager(4096, 4)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        cycle_every_block(bm, 0)
        filled = tracemalloc.get_traced_memory()[0]
        cycle_every_block(bm, 1)
        again = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert bm.num_cached == 4096
    bm.check_invariants()
    # Per-block objects (a digest, a dict entry, a list node) would be over 100 kB here.
    assert filled - start < 16_384, f"filling the cache grew memory by {filled - start} B"
    assert again - start < 16_384, f"evicting and refilling grew memory by {again - start} B"
