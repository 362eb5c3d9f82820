"""The frontend's guided-decoding compiler: caches in front of the compile worker.

`await GuidedCompiler.compile(spec)` answers from memory (LRU by bytes), else from the disk
cache (read on a thread), else compiles in the worker process; a constraint asked for again
while it compiles waits for the same compile. A constraint that failed (bad, crashed the
compiler or took too long) fails again at once: a slow regex sent in a loop costs its limit
once, not once per request. Nothing here blocks the event loop for longer than hashing the
constraint text.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tandem_serve.guided.cache import Compiled, DiskCache, MemoryCache, content_id
from tandem_serve.guided.compile import CompileError
from tandem_serve.guided.pool import CompilePool, CompilerUnavailable
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.guided.vocab import TokenVocabulary, UnsupportedTokenizer
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.guided")

MEMORY_CACHE_BYTES = 64 << 20
MAX_PENDING = 16  # distinct constraints compiling or queued; more are RESOURCE_EXHAUSTED
MAX_FAILURES_KEPT = 1024
PRECOMPILE_LIMIT = 600.0  # the start-up compile of format=JSON runs in the background
JSON_OBJECT = GuidedSpec(SpecKind.JSON_OBJECT, field="params.decoding.format")


class CompileBusy(RuntimeError):
    """Too many distinct constraints are compiling; the client may retry."""


@dataclass(frozen=True)
class GuidedSettings:
    model: str
    vocab_size: int  # the model's (config.json), which may exceed the tokenizer's
    cache_dir: str = ""  # "" = memory only
    compile_timeout: float = 30.0
    memory_bytes: int = MEMORY_CACHE_BYTES
    log_level: str = "INFO"


@dataclass
class GuidedStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    failures: int = 0
    compile_seconds: dict[str, float] = field(default_factory=dict)  # kind -> last compile


class GuidedCompiler:
    def __init__(self, settings: GuidedSettings, fingerprint: str,
                 unsupported: str = "") -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.unsupported = unsupported  # why this tokenizer cannot be guided ("" if it can)
        self.memory = MemoryCache(settings.memory_bytes)
        self.disk = DiskCache(settings.cache_dir, settings.vocab_size)
        self.stats = GuidedStats()
        self._jobs: dict[str, asyncio.Task[Compiled]] = {}
        self._failed: OrderedDict[str, CompileError] = OrderedDict()
        self.pool = CompilePool(self._worker_argv())

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer, settings: GuidedSettings) -> GuidedCompiler:
        """Fingerprints the vocabulary (tens of ms for 32k tokens: call it off the loop)."""
        try:
            vocab = TokenVocabulary.from_tokenizer(tok, settings.vocab_size)
        except UnsupportedTokenizer as e:
            return cls(settings, "", str(e))
        return cls(settings, vocab.fingerprint())

    def _worker_argv(self) -> list[str]:
        s = self.settings
        return [sys.executable, "-m", "tandem_serve.guided.worker", "--model", s.model,
                "--vocab-size", str(s.vocab_size), "--cache-dir", s.cache_dir,
                "--fingerprint", self.fingerprint, "--parent-pid", str(os.getpid()),
                "--log-level", s.log_level]

    def key(self, spec: GuidedSpec) -> str:
        return content_id(spec, self.fingerprint, self.settings.vocab_size)

    async def compile(self, spec: GuidedSpec, limit: float | None = None) -> Compiled:
        """The compiled constraint. CompileError: a bad constraint (the caller names
        `spec.field`); UnsupportedTokenizer, CompileBusy, CompilerUnavailable otherwise."""
        if self.unsupported:
            raise UnsupportedTokenizer(self.unsupported)
        key = self.key(spec)
        failed = self._failed.get(key)
        if failed is not None:
            raise CompileError(str(failed))
        item = self.memory.get(key)
        if item is not None:
            self.stats.memory_hits += 1
            return item
        job = self._jobs.get(key)
        if job is None:
            if len(self._jobs) >= MAX_PENDING:
                raise CompileBusy(f"{MAX_PENDING} constraints are compiling already; "
                                  "retry shortly")
            job = asyncio.ensure_future(self._run(key, spec, limit or
                                                  self.settings.compile_timeout))
            job.add_done_callback(_retrieved)
            self._jobs[key] = job
        # Shielded: a client that goes away does not cancel what others may be waiting for.
        return await asyncio.shield(job)

    async def _run(self, key: str, spec: GuidedSpec, limit: float) -> Compiled:
        try:
            item = await asyncio.to_thread(self.disk.load, key)
            if item is not None:
                self.stats.disk_hits += 1
            else:
                item, figures = await self.pool.compile(key, spec, limit)
                self._note_compile(key, spec, figures)
            self.memory.put(key, item)
            return item
        except CompileError as e:
            self.stats.failures += 1
            log.info("guided %s %s failed to compile: %s", spec.kind.value, key[:12], e)
            self._failed[key] = e
            while len(self._failed) > MAX_FAILURES_KEPT:
                self._failed.popitem(last=False)
            raise
        finally:
            del self._jobs[key]

    def _note_compile(self, key: str, spec: GuidedSpec, figures: dict[str, Any]) -> None:
        seconds = float(figures.get("seconds", 0.0))
        self.stats.compiles += 1
        self.stats.compile_seconds[spec.kind.value] = seconds
        shape = (f", {figures.get('states')} states, {figures.get('classes')} token classes"
                 if spec.kind != SpecKind.GRAMMAR else "")
        log.info("guided %s %s compiled in %.2f s%s", spec.kind.value, key[:12], seconds, shape)

    async def precompile_json(self) -> None:
        """format=JSON into the caches (a background task at start-up; logs, never raises)."""
        start = time.monotonic()
        hits = self.stats.memory_hits + self.stats.disk_hits
        try:
            await self.compile(JSON_OBJECT, max(PRECOMPILE_LIMIT, self.settings.compile_timeout))
        except (CompileError, CompilerUnavailable, CompileBusy, UnsupportedTokenizer) as e:
            if not self.pool.closed:  # else the server is on its way out
                log.warning("format=JSON precompile failed: %s", e)
            return
        how = "found in the cache" if self.stats.memory_hits + self.stats.disk_hits > hits \
            else "compiled"
        log.info("format=JSON %s in %.1f s", how, time.monotonic() - start)

    async def close(self) -> None:
        """Stop the worker; compiles in progress or queued fail with CompilerUnavailable."""
        await self.pool.close()


def _retrieved(task: asyncio.Task[Compiled]) -> None:
    """Every waiter may have gone: mark the outcome seen so asyncio does not warn."""
    if not task.cancelled():
        task.exception()
