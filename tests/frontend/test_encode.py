"""The frontend tokenizes a long prompt off its event loop, so the loop goes on streaming
other clients' tokens meanwhile.  Counted, not timed: the loop's turns that fall inside the
tokenizer's own call (stamped on the thread that makes it)."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

from tandem_serve.frontend.frontend import THREAD_TOKENIZE_CHARS, Frontend
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import byte_level_bpe_dir


class Stamped(Tokenizer):
    """Records the thread and the (start, end) of every encode call."""

    calls: list[tuple[int, int, int]]

    def encode(self, text: str, add_special_tokens: bool = True, **kw: Any) -> list[int]:
        start = time.monotonic_ns()
        ids = super().encode(text, add_special_tokens, **kw)
        self.calls.append((threading.get_ident(), start, time.monotonic_ns()))
        return ids


def tokenizer() -> Stamped:
    tok = Stamped.from_dir(str(byte_level_bpe_dir()))
    assert isinstance(tok, Stamped)
    tok.calls = []
    return tok


async def encode_while_ticking(frontend: Frontend, text: str) -> tuple[list[int], list[int]]:
    """Encode `text` through the frontend while a task takes turns of the loop (a stand-in for
    the routing of other streams' deltas); the ids and when each turn ran."""
    turns: list[int] = []
    done = False

    async def tick() -> None:
        while not done:
            turns.append(time.monotonic_ns())
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    try:
        ids = await frontend.encode(text)
    finally:
        done = True
        await ticker
    return ids, turns


def test_the_loop_keeps_turning_while_a_long_prompt_is_tokenized() -> None:
    tok = tokenizer()
    frontend = Frontend(engine=None, tok=tok)  # type: ignore[arg-type]
    # ~100k characters, tens of ms of encoding: before, a multi-ms stop of every stream.
    text = " ".join(f"river{i} stone lamp" for i in range(5000))
    # The thread that holds the GIL keeps it until it blocks: no turn of the loop can come
    # between the stamp and the tokenizer's call by a forced switch, only while the call
    # itself has released the GIL.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        ids, turns = asyncio.run(encode_while_ticking(frontend, text))
    finally:
        sys.setswitchinterval(interval)
    assert ids == tok.encode(text)
    (thread, start, end), _ = tok.calls
    assert thread != threading.get_ident()  # off the loop's thread
    # With the GIL held for the whole call (tokenizers' plain `encode`, on a thread or not)
    # the loop cannot take a single turn inside it.
    assert sum(start < t < end for t in turns) >= 1


def test_a_thousand_token_prompt_leaves_the_loop_but_a_short_one_stays() -> None:
    tok = tokenizer()
    frontend = Frontend(engine=None, tok=tok)  # type: ignore[arg-type]
    loop_thread = threading.get_ident()
    long_prompt = " ".join(f"word{i}" for i in range(600))  # ~1,000 tokens, ~4,800 chars
    assert len(long_prompt) > THREAD_TOKENIZE_CHARS
    asyncio.run(frontend.encode(long_prompt))
    asyncio.run(frontend.encode("a short prompt"))
    (first, _, _), (second, _, _) = tok.calls
    assert first != loop_thread and second == loop_thread
