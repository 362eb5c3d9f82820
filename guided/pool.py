"""The frontend's handle on its compile worker process (`guided/worker.py`).

A subprocess, not a thread: outlines-core holds the GIL while it builds an index, which would
stall the event loop (every stream) for seconds, and only a process can be stopped mid-compile.
One compile runs at a time (the worker has one core at most, the frontend's reserved one);
the process starts on the first compile, is killed when a compile outlives its limit (the next
compile starts a fresh one), and is stopped by `close()` on every exit of the frontend.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

from tandem_serve.guided.compile import CompileError
from tandem_serve.guided.spec import GuidedSpec
from tandem_serve.guided.wire import compiled_from, frame, spec_message, unframe_length, unpack
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable

log = logging.getLogger("tandem.guided")

STARTUP_TIMEOUT = 120.0  # imports and the vocabulary; minutes only on a starved machine
STOP_GRACE = 1.0


class CompileTimeout(CompileError):
    """The compile outlived its limit; the worker was killed."""


class CompilerUnavailable(RuntimeError):
    """No compile worker: it did not start, or the server is shutting down."""


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class CompilePool:
    def __init__(self, argv: list[str], startup_timeout: float = STARTUP_TIMEOUT) -> None:
        self.argv = argv
        self.startup_timeout = startup_timeout
        self.closed = False
        self.starts = 0  # worker processes started (tests: a killed one is replaced)
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    async def compile(self, key: str, spec: GuidedSpec, limit: float
                      ) -> tuple[GuidedTable | GuidedGrammar, dict[str, Any]]:
        """The compiled constraint and the worker's figures (seconds, states, classes).

        CompileError: the constraint is bad (CompileTimeout: too slow to compile);
        CompilerUnavailable: the worker cannot run it.
        """
        async with self._lock:
            proc = await self._ensure()
            answered = False
            try:
                reply = await asyncio.wait_for(self._exchange(proc, key, spec), limit)
                answered = True
            except asyncio.TimeoutError:
                raise CompileTimeout(f"compiling it took longer than the {limit:g} s limit "
                                     "(--guided-compile-timeout)") from None
            except (asyncio.IncompleteReadError, ConnectionError):
                code = await proc.wait()
                if self.closed:
                    raise CompilerUnavailable("the server is shutting down") from None
                raise CompileError(f"the compiler crashed on it ({_describe_exit(code)})"
                                   ) from None
            finally:
                if not answered:  # its answer would be read as the next request's
                    await self._stop(kill=True)
        if reply.get("key") != key:
            await self._stop(kill=True)
            raise CompilerUnavailable("the compile worker answered out of turn")
        if not reply.get("ok"):
            raise CompileError(str(reply.get("error", "unknown error")))
        return compiled_from(reply["item"]), reply

    async def _exchange(self, proc: asyncio.subprocess.Process, key: str,
                        spec: GuidedSpec) -> dict[str, Any]:
        assert proc.stdin is not None
        proc.stdin.write(frame(spec_message(key, spec)))
        await proc.stdin.drain()
        return await self._read(proc)

    @staticmethod
    async def _read(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        n = unframe_length(await proc.stdout.readexactly(4))
        return unpack(await proc.stdout.readexactly(n))

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self.closed:
            raise CompilerUnavailable("the server is shutting down")
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._proc = proc
        self.starts += 1
        try:
            ready = await asyncio.wait_for(self._read(proc), self.startup_timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            await self._stop(kill=True)
            raise CompilerUnavailable(
                f"the compile worker did not start ({_describe_exit(proc.returncode)}); "
                "see the server log") from None
        except BaseException:
            await self._stop(kill=True)
            raise
        if not ready.get("ready"):
            await self._stop(kill=True)
            raise CompilerUnavailable(f"the compile worker did not start: {ready.get('error')}")
        log.info("guided compile worker started (pid %d) in %.2f s", proc.pid,
                 time.monotonic() - start)
        return proc

    async def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        if not kill and proc.stdin is not None:
            proc.stdin.close()  # the worker exits at the end of its input
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_GRACE)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Stop the worker (a compile in progress fails with CompilerUnavailable)."""
        self.closed = True
        proc = self._proc
        if proc is not None and proc.returncode is None and self._lock.locked():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # mid-compile: the compile's own path reaps it
            await proc.wait()
            return
        await self._stop(kill=False)
