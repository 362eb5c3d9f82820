"""The client patterns of `tandem bench robustness`, each through real gRPC clients: a
burst released at one instant, clients that stop reading, clients that vanish mid-stream."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tandem_serve.harness.relay import HeldRelay
from tandem_serve.harness.stats import percentile

WORDS = "once upon a time the quick brown fox river stone cloud light seven".split()


@dataclass
class Outcome:
    """How one streamed request ended, seen from its client."""

    code: str = "OK"  # or the gRPC status name
    details: str = ""
    messages: int = 0  # received, before the end or the error
    tokens: int = 0
    text: str = ""
    ttft_s: float | None = None  # release to the first generated token
    stop_reason: int = 0


def stream_once(client: Any, text: str, opts: Any, released: float,
                timeout: float = 300.0) -> Outcome:
    import grpc

    out = Outcome()
    parts = []
    try:
        for msg in client.stream(text, opts, timeout=timeout):
            out.messages += 1
            if msg.generated_token_count and out.ttft_s is None:
                out.ttft_s = time.monotonic() - released
            out.tokens = msg.generated_token_count or out.tokens
            out.stop_reason = msg.stop_reason
            parts.append(msg.text)
    except grpc.RpcError as exc:
        out.code = exc.code().name if exc.code() is not None else "UNKNOWN"
        out.details = exc.details() or ""
    out.text = "".join(parts)
    return out


def burst(target: str, jobs: list[tuple[str, Any]], per_channel: int = 16) -> list[Outcome]:
    """Every job's stream started at the same instant, one thread each; their outcomes."""
    from tandem_serve.rpc.client import TandemClient

    clients = [TandemClient(target) for _ in range(0, len(jobs), per_channel)]
    gate = threading.Barrier(len(jobs) + 1)
    released = [0.0]
    results: list[Outcome] = [Outcome() for _ in jobs]

    def run(i: int) -> None:
        gate.wait()
        text, opts = jobs[i]
        results[i] = stream_once(clients[i // per_channel], text, opts, released[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    released[0] = time.monotonic()
    gate.wait()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return results


@dataclass
class OverloadReport:
    sent: int
    admitted: int
    rejected: int
    lost: int  # neither complete nor rejected before any response
    incomplete: int  # admitted but with less output than asked for
    ttft_p50_s: float
    ttft_p99_s: float
    rejection: str  # one rejection's message
    lost_examples: list[str] = field(default_factory=list)


def summarize_overload(outcomes: list[Outcome], tokens: int) -> OverloadReport:
    admitted = [o for o in outcomes if o.code == "OK"]
    rejected = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED" and o.messages == 0]
    lost = [o for o in outcomes if o not in admitted and o not in rejected]
    ttfts = [o.ttft_s for o in admitted if o.ttft_s is not None]
    return OverloadReport(
        sent=len(outcomes), admitted=len(admitted), rejected=len(rejected), lost=len(lost),
        incomplete=sum(o.tokens != tokens for o in admitted),
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        rejection=rejected[0].details if rejected else "",
        lost_examples=[f"{o.code} after {o.messages} messages: {o.details}" for o in lost[:3]])


def overload_jobs(n: int, tokens: int, prompts: list[str]) -> list[tuple[str, Any]]:
    from tandem_serve.rpc.client import GenerateOptions

    opts = GenerateOptions(max_new_tokens=tokens, min_new_tokens=tokens)
    return [(prompts[i % len(prompts)], opts) for i in range(n)]


# ---------------------------------------------------------------------- stalled clients

# A stalled client's flow control pinned to an 8 KiB stream window with no BDP probing, and
# its connection held in a relay (harness/relay.py) so that it takes in nothing more: the
# server's writes block after that window and gRPC's write buffer, and the rest waits in the
# frontend.  (Without the relay a stalled stream took in now about 350 detailed tokens, now
# a whole 1,900-token stream, which then never overflowed.)
STALLED_CHANNEL = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 8192)]


def detailed(tokens: int) -> Any:
    """Options whose every streamed token carries logprob, rank and 10 alternatives."""
    from tandem_serve.rpc.client import GenerateOptions

    return GenerateOptions(max_new_tokens=tokens, min_new_tokens=tokens, generated_tokens=True,
                           token_logprobs=True, token_ranks=True, top_n_tokens=10)


@dataclass
class StalledStream:
    call: Any  # the stream's iterator
    relay: HeldRelay  # held while the client "reads nothing"


@contextmanager
def stalled_streams(target: str, n: int, tokens: int) -> Iterator[list[StalledStream]]:
    """`n` streams whose clients read the head and one token, then nothing more."""
    import grpc

    from tandem_serve.rpc.client import TandemClient

    relays = [HeldRelay(target) for _ in range(n)]
    clients = [TandemClient(channel=grpc.insecure_channel(r.address, options=STALLED_CHANNEL))
               for r in relays]
    streams = []
    try:
        for i, (c, relay) in enumerate(zip(clients, relays, strict=True)):
            call = c.stream(f"Stalled client {i}: {' '.join(WORDS)}", detailed(tokens))
            next(call)
            next(call)
            relay.hold()
            streams.append(StalledStream(call, relay))
        yield streams
    finally:
        for c in clients:
            c.close()
        for r in relays:
            r.close()


def finish_stalled(streams: list[StalledStream]) -> list[Outcome]:
    """Read every stalled stream to its end (the clients resume)."""
    import grpc

    outs = []
    for s in streams:
        s.relay.release()
        o = Outcome(messages=2)
        try:
            for _ in s.call:
                o.messages += 1
        except grpc.RpcError as exc:
            o.code, o.details = exc.code().name, exc.details() or ""
        outs.append(o)
    return outs


# ---------------------------------------------------------------------- vanishing clients


def vanish(target: str, n: int, tokens: int) -> list[str]:
    """`n` clients, all mid-stream at once, then half cancel and half close their channel;
    returns the errors of clients that could not get there (empty: all did)."""
    from tandem_serve.rpc.client import GenerateOptions, TandemClient

    opts = GenerateOptions(max_new_tokens=tokens, min_new_tokens=tokens)
    gate = threading.Barrier(n + 1, timeout=300)
    errors: list[str] = []

    def client(i: int) -> None:
        own = TandemClient(target)
        try:
            call: Any = own.stream(f"Client {i} says: once upon a time", opts)
            for msg in call:
                if msg.generated_token_count:  # mid-stream: more tokens are coming
                    break
            gate.wait()
            if i % 2:
                call.cancel()  # a client that gives up; the others just go away
        except Exception as exc:
            errors.append(f"client {i}: {exc!r}")
            gate.abort()
        finally:
            own.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        gate.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join(120)
    return errors
