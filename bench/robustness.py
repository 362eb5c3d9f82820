"""`tandem bench robustness`: overload, stalled and vanishing clients, role restarts.

Each part starts its own server (the tiny default model unless `--model`), drives one
pattern through real gRPC clients and prints what happened:

- overload: a burst of 10x what admission control admits (`--max-queued-requests` waiting
  plus `--max-num-seqs` running) released at once: admitted, rejected (RESOURCE_EXHAUSTED
  before any response), lost (anything else: must be 0), and TTFT of the admitted ones;
- stalled: clients that stop reading big detailed streams: how many were cancelled at the
  stream buffer limit, the frontend's RSS before and after, and whether a client that reads
  kept flowing meanwhile;
- vanish: clients that disconnect mid-stream (half cancel, half close their connection):
  KV blocks leaked and requests left running afterwards (must be 0);
- restart: the compose roles started one by one (`bench.roles`), one role killed and started
  again as compose's restart policy would: how long the frontend was NOT_SERVING.

The same functions drive the end-to-end tests at a small size.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


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

# Flow control as a plain client without BDP probing has it (a 64 KiB stream window): the
# server's writes block after that much, and the rest waits in the frontend.
STALLED_CHANNEL = [("grpc.http2.bdp_probe", 0)]


def detailed(tokens: int) -> Any:
    """Options whose every streamed token carries logprob, rank and 10 alternatives."""
    from tandem_serve.rpc.client import GenerateOptions

    return GenerateOptions(max_new_tokens=tokens, min_new_tokens=tokens, generated_tokens=True,
                           token_logprobs=True, token_ranks=True, top_n_tokens=10)


@contextmanager
def stalled_streams(target: str, n: int, tokens: int) -> Iterator[list[Any]]:
    """`n` streams whose clients read the head and one token, then nothing more."""
    import grpc

    from tandem_serve.rpc.client import TandemClient

    clients = [TandemClient(channel=grpc.insecure_channel(target, options=STALLED_CHANNEL))
               for _ in range(n)]
    calls = []
    try:
        for i, c in enumerate(clients):
            call = c.stream(f"Stalled client {i}: {' '.join(WORDS)}", detailed(tokens))
            next(call)
            next(call)
            calls.append(call)
        yield calls
    finally:
        for c in clients:
            c.close()


def finish_stalled(calls: list[Any]) -> list[Outcome]:
    """Read every stalled stream to its end (the clients resume)."""
    import grpc

    outs = []
    for call in calls:
        o = Outcome(messages=2)
        try:
            for _ in call:
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


def wait_idle(client: Any, timeout: float = 60.0) -> Any:
    """The admin stats once every block is free and nothing runs or waits (else the last)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if (s.num_free_blocks, s.num_running, s.num_waiting) == (s.num_total_blocks, 0, 0):
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.05)


# ---------------------------------------------------------------------- the command


def _server(model: str, flags: list[str]) -> Any:
    from tandem_serve.bench.soak import start_server, wait_serving
    from tandem_serve.rpc.client import TandemClient

    proc, target = start_server(model, flags)
    client = TandemClient(target)
    wait_serving(client, proc, timeout=300)
    return proc, target, client


def _stop(proc: Any, client: Any) -> None:
    import signal

    client.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def run_overload(args: argparse.Namespace) -> dict[str, Any]:
    q, s = args.max_queued_requests, args.max_num_seqs
    proc, target, client = _server(args.model, ["--max-queued-requests", str(q),
                                                "--max-num-seqs", str(s)])
    try:
        n = 10 * (q + s)
        report = summarize_overload(burst(target, overload_jobs(n, args.tokens, WORDS[:8])),
                                    args.tokens)
    finally:
        _stop(proc, client)
    print(f"overload: burst of {report.sent} (10x {q} queued + {s} running) → admitted "
          f"{report.admitted}, rejected {report.rejected} (RESOURCE_EXHAUSTED before any "
          f"response), lost {report.lost}, admitted but incomplete {report.incomplete}; "
          f"TTFT of the admitted p50 {report.ttft_p50_s * 1e3:.0f} ms, p99 "
          f"{report.ttft_p99_s * 1e3:.0f} ms")
    if report.rejection:
        print(f"  rejection: {report.rejection}")
    return asdict(report)


SETTLE_S = 5.0


def _stalled_arm(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    from tandem_serve.bench.soak import rss_kb
    from tandem_serve.rpc.client import GenerateOptions

    proc, target, client = _server(args.model, ["--max-stream-buffer-bytes", str(limit),
                                                "--max-new-tokens", "2000"])
    try:
        list(client.stream("warm", detailed(64)))  # allocator pools before the baseline
        time.sleep(SETTLE_S)  # the frontend gives back start-up memory for a while
        before = rss_kb(proc.pid) or 0
        with stalled_streams(target, args.stalled, args.stall_tokens) as calls:
            # Cancelled (with a limit) or finished (without): nothing runs any more.
            idle = wait_idle(client, timeout=600)
            during = rss_kb(proc.pid) or 0
            t0 = time.monotonic()
            other = list(client.stream("Meanwhile", GenerateOptions(max_new_tokens=64,
                                                                    min_new_tokens=64)))
            other_s = time.monotonic() - t0
            outs = finish_stalled(calls)
    finally:
        _stop(proc, client)
    return {"limit_bytes": limit, "stalled": len(outs),
            "cancelled": sum(o.code == "RESOURCE_EXHAUSTED" for o in outs),
            "frontend_rss_before_mb": before / 1024, "frontend_rss_stalled_mb": during / 1024,
            "frontend_growth_mb": (during - before) / 1024,
            "idle_while_stalled": idle.num_free_blocks == idle.num_total_blocks,
            "other_stream_tokens": other[-1].generated_token_count if other else 0,
            "other_stream_s": other_s}


def run_stalled(args: argparse.Namespace) -> dict[str, Any]:
    """The stalled clients with the stream buffer limit, then without one (0)."""
    arms = {}
    for limit in (args.max_stream_buffer_bytes, 0):
        r = arms[str(limit)] = _stalled_arm(args, limit)
        print(f"stalled, --max-stream-buffer-bytes {limit}{' (no limit)' if not limit else ''}:"
              f" {r['stalled']} clients stopped reading {args.stall_tokens}-token detailed "
              f"streams → {r['cancelled']} cancelled; frontend RSS "
              f"{r['frontend_rss_before_mb']:.1f} MB idle, {r['frontend_rss_stalled_mb']:.1f} MB "
              f"with them all stalled ({r['frontend_growth_mb']:+.1f} MB); a reading client got "
              f"its {r['other_stream_tokens']} tokens in {r['other_stream_s']:.2f} s meanwhile")
    return arms


def run_vanish(args: argparse.Namespace) -> dict[str, Any]:
    proc, target, client = _server(args.model, ["--max-num-seqs", str(max(64, args.vanish))])
    try:
        errors = vanish(target, args.vanish, 1000)
        s = wait_idle(client)
    finally:
        _stop(proc, client)
    out = {"clients": args.vanish, "errors": errors,
           "blocks_leaked": s.num_total_blocks - s.num_free_blocks,
           "running": s.num_running, "waiting": s.num_waiting}
    print(f"vanish: {args.vanish} clients disconnected mid-stream (half cancel, half close "
          f"the connection) → {out['blocks_leaked']} KV blocks leaked, {s.num_running} "
          f"running, {s.num_waiting} waiting{'; errors: ' + str(errors) if errors else ''}")
    return out


def _restart_one(roles: Any, client: Any, role: str) -> dict[str, Any]:
    """Kill `role` (SIGKILL) and time the set's way back; the frontend must stay unless it
    is the one killed."""
    from tandem_serve.bench.roles import wait_health, wait_serving_anew

    frontend = roles.procs["frontend"]
    t0 = time.monotonic()
    roles.kill(role)
    if role == "frontend":  # nobody to say NOT_SERVING: its port is closed
        detected = float("nan")
    else:
        detected = wait_health(client, False, 60, frontend)
    wait_serving_anew(roles.target, 600)
    back = time.monotonic() - t0
    texts = [m.text for m in client.stream("After the restart", detailed(8))]
    return {"role": role, "not_serving_after_s": detected, "serving_again_after_s": back,
            "frontend_kept": roles.procs["frontend"] is frontend,
            "roles_restarted": sorted({e.role for e in roles.exits_since(t0)}),
            "serves": len(texts) > 1}


def run_restart(args: argparse.Namespace) -> dict[str, Any]:
    """The compose roles (bench.roles), each role killed in turn."""
    import tempfile

    from tandem_serve.bench.roles import RoleSet, wait_health
    from tandem_serve.rpc.client import TandemClient

    model = args.model
    if not model:
        from tandem_serve.gpu_worker.tiny_model import ensure_default_model

        model = str(ensure_default_model(in_subprocess=True))
    roles = RoleSet(model, tempfile.mkdtemp(prefix="tandem-roles-"))
    roles.start_all()
    roles.restart_policy()
    client = TandemClient(roles.target)
    results = []
    try:
        wait_health(client, True, 600, roles.procs["frontend"])
        for role in ("scheduler", "gpu-worker", "postproc-0", "frontend"):
            r = _restart_one(roles, client, role)
            results.append(r)
            noticed = (f"NOT_SERVING after {r['not_serving_after_s']:.2f} s, "
                       if role != "frontend" else "")
            print(f"restart: {role} killed → {noticed}SERVING again after "
                  f"{r['serving_again_after_s']:.2f} s; the frontend "
                  f"{'kept running' if r['frontend_kept'] else 'was restarted'}; roles "
                  f"restarted: {', '.join(r['roles_restarted'])}")
    finally:
        client.close()
        roles.stop()
    return {"kills": results}


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "overload": run_overload, "stalled": run_stalled, "vanish": run_vanish,
    "restart": run_restart,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="checkpoint folder (default: the tiny model)")
    p.add_argument("--only", default="", help=f"comma-separated parts of {','.join(PARTS)}")
    p.add_argument("--max-queued-requests", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per overload request")
    p.add_argument("--stalled", type=int, default=32, help="clients that stop reading")
    p.add_argument("--stall-tokens", type=int, default=1900)
    p.add_argument("--max-stream-buffer-bytes", type=int, default=64 << 10,
                   help="the stalled part's limit (it also runs without one)")
    p.add_argument("--vanish", type=int, default=100, help="clients that disconnect")
    p.add_argument("--json", default="", help="write every part's figures here")


def main(args: argparse.Namespace) -> int:
    parts = [s for s in args.only.split(",") if s] or list(PARTS)
    unknown = [s for s in parts if s not in PARTS]
    if unknown:
        raise SystemExit(f"--only: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    results = {name: PARTS[name](args) for name in parts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = (results.get("overload", {}).get("lost", 0)
           or results.get("vanish", {}).get("blocks_leaked", 0))
    return 1 if bad else 0
