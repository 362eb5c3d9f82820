"""`guided.cache`: content ids, the memory LRU and the disk cache."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem_serve.guided.cache import DiskCache, MemoryCache, check_table, content_id, nbytes
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable

V = 50


def make_table(key: str, states: int = 3, classes: int = 4) -> GuidedTable:
    rng = np.random.default_rng(len(key))
    next_state = rng.integers(-1, states + 1, (states + 1, classes)).astype(np.int32)
    return GuidedTable(key, next_state, rng.integers(0, classes, V).astype(np.int32))


def test_content_id_depends_on_everything_a_table_does() -> None:
    spec = GuidedSpec(SpecKind.REGEX, "[0-9]+", field="params.decoding.regex")
    base = content_id(spec, "fp", 100)
    assert base == content_id(GuidedSpec(SpecKind.REGEX, "[0-9]+", field="other"), "fp", 100)
    assert len({base, content_id(spec, "fp2", 100), content_id(spec, "fp", 101),
                content_id(GuidedSpec(SpecKind.REGEX, "[0-9]*"), "fp", 100),
                content_id(GuidedSpec(SpecKind.GRAMMAR, "[0-9]+"), "fp", 100)}) == 5
    # Choice lists are compared as lists, not as a joined string.
    a = content_id(GuidedSpec(SpecKind.CHOICE, choices=("a,b", "c")), "fp", 100)
    b = content_id(GuidedSpec(SpecKind.CHOICE, choices=("a", "b,c")), "fp", 100)
    assert a != b


def test_memory_cache_evicts_least_recently_used_by_bytes() -> None:
    one = nbytes(make_table("a"))
    cache = MemoryCache(max_bytes=3 * one)
    for key in "abc":
        cache.put(key, make_table(key))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", make_table("d"))
    assert cache.get("b") is None and cache.get("a") is not None
    assert len(cache) == 3 and cache.bytes == 3 * one
    cache.put("huge", make_table("huge", states=400))  # larger than the whole cache
    assert cache.get("huge") is None and len(cache) == 3
    cache.put("g", GuidedGrammar("g", "start: /x/"))
    assert cache.bytes <= cache.max_bytes


def test_disk_round_trip_is_atomic(tmp_path: Path) -> None:
    disk = DiskCache(str(tmp_path / "guided"), V)
    assert disk.load("k1") is None  # no folder yet
    t = make_table("k1")
    disk.store(t)
    disk.store(GuidedGrammar("k2", "start: /[0-9]+/"))
    back = disk.load("k1")
    assert isinstance(back, GuidedTable) and back.table_id == "k1"
    assert np.array_equal(back.next_state, t.next_state)
    assert np.array_equal(back.token_class, t.token_class)
    assert disk.load("k2") == GuidedGrammar("k2", "start: /[0-9]+/")
    assert sorted(p.name for p in (tmp_path / "guided").iterdir()) == ["k1.npz", "k2.lark"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other id", "other vocab"])
def test_a_corrupt_file_is_removed_and_recompiled(tmp_path: Path, damage: str) -> None:
    disk = DiskCache(str(tmp_path), V)
    disk.store(make_table("k1"))
    path = tmp_path / "k1.npz"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"not a zip file")
    elif damage == "other id":
        disk.store(make_table("k2"))
        (tmp_path / "k2.npz").replace(path)
    else:
        DiskCache(str(tmp_path), V + 1).store(GuidedTable(
            "k1", make_table("k1").next_state, np.zeros(V + 1, np.int32)))
    assert disk.load("k1") is None
    assert not path.exists()


def test_no_folder_means_no_disk_cache(tmp_path: Path) -> None:
    disk = DiskCache("", V)
    disk.store(make_table("k1"))
    assert disk.load("k1") is None


def test_an_unwritable_folder_only_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    DiskCache(str(blocker / "guided"), V).store(make_table("k1"))
    assert "cannot write" in caplog.text


def test_check_table_names_the_problem() -> None:
    t = make_table("k")
    assert check_table(t, V) == ""
    assert "vocabulary of 51" in check_table(t, V + 1)
    bad = GuidedTable("k", t.next_state.copy(), t.token_class)
    bad.next_state[0, 0] = 99
    assert check_table(bad, V) == "a next state out of range"
