"""The compile worker: a child of the frontend that compiles constraints one at a time.

`python -m guided.worker --model DIR --vocab-size N [--cache-dir DIR] [--parent-pid PID]`
reads compile requests on stdin and answers on stdout (`guided/wire.py`); its log goes to
stderr, which is the frontend's. It writes what it compiled into the disk cache itself.

It inherits the frontend's CPU affinity (the reserved cores when the model runs on the CPU),
so it never takes the gpu worker's cores, and runs niced: a compile yields to the processes
that stream tokens. SIGTERM and SIGKILL end it at once (there is nothing to clean up but a
temporary file, which the cache ignores); the frontend kills it to stop an overlong compile,
and its parent's death kills it too (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any, BinaryIO

from tandem_serve.guided.cache import DiskCache
from tandem_serve.guided.compile import CompileError, Compiler
from tandem_serve.guided.wire import compiled_message, frame, read_message, spec_from
from tandem_serve.ipc.process import die_with_parent, set_title, setup_logging
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.guided")
NICENESS = 10
TITLE = "tandem: guided-compile"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m guided.worker")
    p.add_argument("--model", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--fingerprint", default="", help="the frontend's; refuse to start if ours "
                                                     "differs (a changed tokenizer)")
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _answer(compiler: Compiler, disk: DiskCache, request: dict[str, Any]) -> dict[str, Any]:
    key = str(request["key"])
    try:
        item, stats = compiler.compile(spec_from(request), key)
    except CompileError as e:
        return {"key": key, "ok": False, "error": str(e)}
    except Exception as e:  # a compiler bug: the request fails, the worker goes on
        log.exception("compiling %s failed", key[:12])
        return {"key": key, "ok": False, "error": f"the compiler failed: {type(e).__name__}: {e}"}
    disk.store(item)
    return {"key": key, "ok": True, "item": compiled_message(item), "seconds": stats.seconds,
            "states": stats.states, "classes": stats.classes}


def serve(args: argparse.Namespace, out: BinaryIO, inp: BinaryIO) -> int:
    def send(message: dict[str, Any]) -> None:
        out.write(frame(message))
        out.flush()

    try:
        compiler = Compiler(Tokenizer.from_dir(args.model), args.vocab_size)
        fingerprint = compiler.vocab.fingerprint()
        if args.fingerprint and fingerprint != args.fingerprint:
            raise RuntimeError("the model's tokenizer changed since the server started")
    except Exception as e:
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    set_title(TITLE)  # from now on it is compiling or waiting to (tests look for this)
    send({"ready": True, "fingerprint": fingerprint})
    disk = DiskCache(args.cache_dir, args.vocab_size)
    while (request := read_message(inp)) is not None:
        send(_answer(compiler, disk, request))
    return 0  # the frontend closed our stdin


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    # The protocol gets its own copy of stdout; fd 1 becomes stderr, so a library that
    # prints cannot corrupt an answer.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    setup_logging("guided-compile", args.log_level)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    return serve(args, out, sys.stdin.buffer)


if __name__ == "__main__":
    sys.exit(main())
