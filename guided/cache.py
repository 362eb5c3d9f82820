"""Content ids and the two caches of compiled constraints: memory (LRU by bytes) and disk.

A content id is the sha256 of everything a compiled constraint depends on: its kind and
text, the vocabulary's fingerprint (bytes per id, EOS ids, vocab size), the compiler's
version and our format version. Equal ids mean interchangeable tables, across requests,
restarts and servers sharing a cache folder; the scheduler and gpu worker key tables by it.

On disk each entry is one file named by its id (`<id>.npz` for a table, `<id>.lark` for a
grammar), written to a temporary name and renamed, so a reader never sees half a file. A file
that does not load or does not hold a table of the expected shape is removed and recompiled.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

import numpy as np

from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable

log = logging.getLogger("tandem.guided")

FORMAT_VERSION = 1
Compiled = GuidedTable | GuidedGrammar


@functools.cache  # a metadata lookup reads the filesystem; ids are computed per request
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def constraint_text(spec: GuidedSpec) -> str:
    if spec.kind == SpecKind.CHOICE:
        return json.dumps(list(spec.choices), ensure_ascii=False)
    return spec.value


def content_id(spec: GuidedSpec, fingerprint: str, vocab_size: int) -> str:
    compiler = ("llguidance " + _version("llguidance") if spec.kind == SpecKind.GRAMMAR
                else "outlines-core " + _version("outlines-core"))
    h = hashlib.sha256()
    for part in (spec.kind.value, constraint_text(spec), fingerprint, str(vocab_size),
                 compiler, str(FORMAT_VERSION)):
        h.update(len(part.encode()).to_bytes(8, "little") + part.encode())
    return h.hexdigest()


def nbytes(item: Compiled) -> int:
    if isinstance(item, GuidedTable):
        return int(item.next_state.nbytes + item.token_class.nbytes)
    return len(item.lark.encode())


class MemoryCache:
    """Least recently used first out, bounded by the compiled items' bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Compiled] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Compiled | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: str, item: Compiled) -> None:
        if key in self._items:
            self.bytes -= nbytes(self._items.pop(key))
        size = nbytes(item)
        if size > self.max_bytes:  # would evict everything and still not fit
            return
        self._items[key] = item
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= nbytes(old)


class DiskCache:
    """One file per content id under `folder` (created on first write); "" = no disk cache."""

    def __init__(self, folder: str, vocab_size: int) -> None:
        self.folder = Path(folder) if folder else None
        self.vocab_size = vocab_size

    def _path(self, key: str, suffix: str) -> Path | None:
        return self.folder / f"{key}{suffix}" if self.folder is not None else None

    def load(self, key: str) -> Compiled | None:
        for suffix, reader in ((".npz", self._read_table), (".lark", self._read_grammar)):
            path = self._path(key, suffix)
            if path is None or not path.exists():
                continue
            try:
                return reader(key, path)
            except Exception as e:  # truncated, garbled or foreign: recompile instead
                log.warning("guided cache: removing unreadable %s (%s)", path, e)
                path.unlink(missing_ok=True)
        return None

    def _read_table(self, key: str, path: Path) -> GuidedTable:
        with np.load(path, allow_pickle=False) as f:
            table = GuidedTable(table_id=str(f["table_id"]),
                                next_state=np.ascontiguousarray(f["next_state"]),
                                token_class=np.ascontiguousarray(f["token_class"]),
                                initial_state=int(f["initial_state"]))
        problem = check_table(table, self.vocab_size)
        if table.table_id != key:
            problem = f"it holds table {table.table_id[:12]}"
        if problem:
            raise ValueError(problem)
        return table

    @staticmethod
    def _read_grammar(key: str, path: Path) -> GuidedGrammar:
        return GuidedGrammar(grammar_id=key, lark=path.read_text(encoding="utf-8"))

    def store(self, item: Compiled) -> None:
        """Atomically; a failure to write only costs a later recompile."""
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if isinstance(item, GuidedTable):
                self._write(item.table_id, ".npz", lambda f: np.savez(
                    f, table_id=np.str_(item.table_id), next_state=item.next_state,
                    token_class=item.token_class, initial_state=np.int64(item.initial_state)))
            else:
                self._write(item.grammar_id, ".lark",
                            lambda f: f.write(item.lark.encode("utf-8")))
        except OSError as e:
            log.warning("guided cache: cannot write to %s: %s", self.folder, e)

    def _write(self, key: str, suffix: str, write: Callable[[BinaryIO], object]) -> None:
        assert self.folder is not None
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, self.folder / f"{key}{suffix}")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def check_table(table: GuidedTable, vocab_size: int) -> str:
    """What is wrong with a table's shape or entries ("" if nothing)."""
    ns, tc = table.next_state, table.token_class
    if ns.dtype != np.int32 or tc.dtype != np.int32 or ns.ndim != 2 or tc.ndim != 1:
        return f"wrong arrays ({ns.dtype} {ns.shape}, {tc.dtype} {tc.shape})"
    if tc.shape[0] != vocab_size:
        return f"{tc.shape[0]} token classes for a vocabulary of {vocab_size}"
    rows, classes = ns.shape
    if rows < 2 or classes < 1 or not 0 <= table.initial_state < rows - 1:
        return f"shape {ns.shape} with initial state {table.initial_state}"
    if tc.min() < 0 or tc.max() >= classes:
        return "a token class out of range"
    if ns.min() < -1 or ns.max() >= rows:
        return "a next state out of range"
    return ""
