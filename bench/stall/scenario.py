"""One run of the stall scenario against a running server: streams decoding while long
prompts arrive, every token stamped on arrival at the client.

Decoding streams are greedy with min = max new tokens (EOS cannot end them early); each
starts with a short prompt of its own.  Once they all decode, `prompts` long prompts of
about `prompt_len` tokens arrive `interval` seconds apart, each generating a few tokens.
The window measured runs from the first long prompt's arrival to the last one's first
token (plus `tail`), so it holds every step that carried a prompt's prefill.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem_serve.ipc.process import freeze_heap
from tandem_serve.rpc.client import GenerateOptions, TandemClient

WORDS = ("river stone lamp orbit velvet quiet harbor maple signal copper lantern meadow "
         "falcon ember tide cobalt prism thistle saddle glacier").split()



class GapRatios:
    """A stream's worst and p99 inter-token gap as multiples of its median (the stall's
    figures, whichever clock measured the gaps)."""

    median_gap_ms: float
    p99_gap_ms: float
    worst_gap_ms: float

    @property
    def worst_ratio(self) -> float:
        return self.worst_gap_ms / self.median_gap_ms

    @property
    def p99_ratio(self) -> float:
        return self.p99_gap_ms / self.median_gap_ms

@dataclass(frozen=True)
class StallWorkload:
    streams: int = 4
    prompts: int = 6
    prompt_len: int = 1000
    interval: float = 1.2
    stream_tokens: int = 1900  # more than the window needs: the streams are cut after it
    prompt_tokens: int = 16  # what each long prompt generates
    tail: float = 0.3


@dataclass
class Stamps:
    """Arrival times (time.monotonic) of each stream's tokens and of each prompt's."""

    streams: list[list[float]] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)  # each long prompt's send time
    first: list[float] = field(default_factory=list)  # its first token's arrival
    prompt_tokens: list[list[float]] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)


def text_of(tokenizer: Any, n: int, seed: int) -> str:
    """About `n` tokens of words, different for every seed (no prefix-cache hits)."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n))
    return str(tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[: n - 1]))


def _consume(call: Any, out: list[float], ready: threading.Event | None = None) -> None:
    """Stamp every token of a stream: a response carrying several stamps them at once."""
    count = 0
    try:
        for resp in call:
            now = time.monotonic()
            new = resp.generated_token_count - count
            if new > 0:
                out.extend([now] * new)
                count = resp.generated_token_count
                if ready is not None:
                    ready.set()
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise


def run(target: str, tokenizer: Any, work: StallWorkload, seed: int) -> Stamps:
    # Every prompt's text is made before the clock starts: building a long one (~7 ms of
    # this process's CPU, holding its GIL) at its arrival stalled the threads stamping the
    # other streams' tokens by as much, right when the stall is measured.
    texts = [text_of(tokenizer, 12, seed * 1000 + i) for i in range(work.streams)]
    prompts = [text_of(tokenizer, work.prompt_len, seed * 1000 + 100 + j)
               for j in range(work.prompts)]
    freeze_heap()  # nor may a full collection of this process's heap stall them
    client = TandemClient(target)
    stamps = Stamps(streams=[[] for _ in range(work.streams)],
                    prompt_tokens=[[] for _ in range(work.prompts)])
    calls: list[Any] = []  # grpc's stream calls: iterators with cancel()
    threads = []
    try:
        started = [threading.Event() for _ in range(work.streams)]
        opts = GenerateOptions(max_new_tokens=work.stream_tokens,
                               min_new_tokens=work.stream_tokens)
        for i in range(work.streams):
            call = client.stream(texts[i], opts)
            calls.append(call)
            threads.append(threading.Thread(target=_consume,
                                            args=(call, stamps.streams[i], started[i])))
        for t in threads:
            t.start()
        for ev in started:
            if not ev.wait(60):
                raise TimeoutError("a decoding stream never started")
        time.sleep(0.3)  # past the streams' own prefills
        prompt_opts = GenerateOptions(max_new_tokens=work.prompt_tokens,
                                      min_new_tokens=work.prompt_tokens)
        arrivals = []
        for j in range(work.prompts):
            if j:
                time.sleep(max(0.0, stamps.sent[0] + j * work.interval - time.monotonic()))
            stamps.sent.append(time.monotonic())
            call = client.stream(prompts[j], prompt_opts)
            t = threading.Thread(target=_consume, args=(call, stamps.prompt_tokens[j]))
            t.start()
            arrivals.append(t)
        for t in arrivals:
            t.join(300)
        stamps.first = [tokens[0] for tokens in stamps.prompt_tokens]
        stamps.window = (stamps.sent[0], max(stamps.first) + work.tail)
        while time.monotonic() < stamps.window[1]:
            time.sleep(0.01)
    finally:
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(30)
        client.close()
    return stamps
