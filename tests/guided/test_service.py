"""`guided.service` + `guided.pool`: caches in front of a real compile worker process."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tandem_serve.guided.compile import CompileError
from tandem_serve.guided.pool import CompilerUnavailable, CompileTimeout
from tandem_serve.guided.service import GuidedCompiler, GuidedSettings
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.guided.vocab import UnsupportedTokenizer
from tandem_serve.proto.guided_messages import GuidedTable
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import sentencepiece_dir, wordpiece_dir

REPO = Path(__file__).resolve().parents[2]
DIGITS = GuidedSpec(SpecKind.REGEX, "[0-9]{3}", field="params.decoding.regex")
SLOW = GuidedSpec(SpecKind.JSON_OBJECT, field="params.decoding.format")  # 8-20 s to compile


def make(cache: Path | str, timeout: float = 60.0, folder: Path | None = None
         ) -> GuidedCompiler:
    folder = folder or sentencepiece_dir()
    tok = Tokenizer.from_dir(str(folder))
    return GuidedCompiler.for_tokenizer(tok, GuidedSettings(
        model=str(folder), vocab_size=tok.vocab_size, cache_dir=str(cache),
        compile_timeout=timeout))


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_one_compile_then_memory_then_disk_in_a_fresh_compiler(tmp_path: Path) -> None:
    async def body() -> None:
        c = make(tmp_path)
        try:
            first = await asyncio.gather(*(c.compile(DIGITS) for _ in range(3)))
            assert all(t is first[0] for t in first) and isinstance(first[0], GuidedTable)
            assert (c.stats.compiles, c.pool.starts) == (1, 1)
            assert await c.compile(DIGITS) is first[0]
            assert c.stats.memory_hits == 1
            with pytest.raises(CompileError, match="unclosed group"):
                await c.compile(GuidedSpec(SpecKind.REGEX, "([0-9]"))
            assert c.pool.starts == 1  # a bad constraint does not cost the worker
            pid = c.pool.pid
        finally:
            await c.close()
        assert pid is not None and gone(pid)
        fresh = make(tmp_path)
        try:
            again = await fresh.compile(DIGITS)
            assert fresh.stats.disk_hits == 1 and fresh.pool.starts == 0
            assert isinstance(again, GuidedTable) and again.table_id == first[0].table_id
            assert (again.next_state == first[0].next_state).all()
        finally:
            await fresh.close()
    run(body)


def test_a_slow_compile_is_killed_and_fails_fast_afterwards(tmp_path: Path) -> None:
    async def body() -> None:
        c = make(tmp_path, timeout=1.0)
        try:
            await c.compile(DIGITS)  # the worker is up: the limit is all compile
            pid = c.pool.pid
            assert pid is not None
            with pytest.raises(CompileTimeout, match=r"longer than the 1 s limit "
                                                     r"\(--guided-compile-timeout\)"):
                await c.compile(SLOW)
            assert gone(pid)
            assert isinstance(await c.compile(GuidedSpec(SpecKind.CHOICE, choices=("a", "b"))),
                              GuidedTable)
            assert c.pool.starts == 2 and c.pool.pid != pid
            start = time.monotonic()
            with pytest.raises(CompileError, match="longer than the 1 s limit"):
                await c.compile(SLOW)  # remembered: no second minute of a core
            assert time.monotonic() - start < 0.5
        finally:
            await c.close()
        assert not list(tmp_path.glob("*.tmp"))
    run(body)


def test_a_crashed_compile_fails_its_request_and_the_next_one_works(tmp_path: Path) -> None:
    async def body() -> None:
        c = make(tmp_path)
        try:
            await c.compile(DIGITS)
            pid = c.pool.pid
            assert pid is not None
            slow = asyncio.ensure_future(c.compile(SLOW))
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(CompileError, match="crashed on it .killed by SIGKILL"):
                await slow
            assert isinstance(await c.compile(GuidedSpec(SpecKind.REGEX, "x+")), GuidedTable)
            assert c.pool.starts == 2
        finally:
            await c.close()
    run(body)


def test_close_stops_a_running_compile_and_refuses_new_ones(tmp_path: Path) -> None:
    async def body() -> None:
        c = make(tmp_path)
        await c.compile(DIGITS)
        pid = c.pool.pid
        assert pid is not None
        slow = asyncio.ensure_future(c.compile(SLOW))
        await asyncio.sleep(0.3)
        await c.close()
        assert gone(pid)
        with pytest.raises(CompilerUnavailable, match="shutting down"):
            await slow
        with pytest.raises(CompilerUnavailable):
            await c.compile(GuidedSpec(SpecKind.REGEX, "y+"))
    run(body)


def test_a_tokenizer_that_cannot_be_guided_is_said_once_per_request(tmp_path: Path) -> None:
    async def body() -> None:
        c = make(tmp_path, folder=wordpiece_dir())
        with pytest.raises(UnsupportedTokenizer, match="byte-level BPE or SentencePiece"):
            await c.compile(DIGITS)
        assert c.pool.starts == 0
        await c.close()
    run(body)


def test_the_frontend_and_the_compiler_load_neither_torch_nor_transformers() -> None:
    code = (
        "import sys\n"
        "import tandem.launcher, rpc.server, frontend.guided, guided.service, guided.worker\n"
        "from tandem_serve.guided.compile import Compiler\n"
        "from tandem_serve.guided.spec import GuidedSpec, SpecKind\n"
        "from tandem_serve.tokenization.tokenizer import Tokenizer\n"
        f"tok = Tokenizer.from_dir({str(sentencepiece_dir())!r})\n"
        "c = Compiler(tok, tok.vocab_size)\n"
        "c.compile(GuidedSpec(SpecKind.JSON_SCHEMA, '{\"type\": \"boolean\"}'), 'k')\n"
        "c.compile(GuidedSpec(SpecKind.GRAMMAR, 'root ::= \"a\"+'), 'g')\n"
        "bad = [m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_precompiling_json_warms_the_memory_cache(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """At start-up the launcher runs precompile_json(); a table on disk costs no compile."""
    import numpy as np

    from tandem_serve.guided.service import JSON_OBJECT

    c = make(tmp_path)
    key = c.key(JSON_OBJECT)
    table = GuidedTable(key, np.array([[1, -1], [1, 1]], np.int32),
                        np.zeros(c.settings.vocab_size, np.int32))
    c.disk.store(table)
    caplog.set_level("INFO", logger="tandem.guided")

    async def body() -> None:
        await c.precompile_json()
        assert c.memory.get(key) is not None
        assert await c.compile(GuidedSpec(SpecKind.JSON_OBJECT, field="x")) is c.memory.get(key)
        await c.close()
    run(body)
    assert c.pool.starts == 0 and c.stats.disk_hits == 1
    assert "format=JSON found in the cache" in caplog.text
