"""`tandem bench stall`: how long decoding streams wait while long prompts arrive.

Mixed steps (prefill chunks inside the decode steps, the default) against the baseline
`--prefill-phase` (each plan's prefill in a forward of its own before its steps), in one
run: both servers start once, then every round runs the scenario (`scenario.py`) on each,
back to back, with the same prompts.  Per arm and round: the streams' median, p99 and worst
inter-token gap inside the arrival window, the long prompts' time to first token and the
tokens per second of the window; then the medians over rounds of the within-round ratios
(`report.py`).  `--budgets` runs one mixed arm per per-step token budget instead, and a last
table sets each budget's worst gap against its long-prompt TTFT: the trade the default
budget (`scheduler.budget.default_tokens`) picks a point of.

Served, the gaps are what a gRPC client sees (`scenario.py`); `--in-process` measures the
device's steps alone, on the worker's CPU clock (`inproc.py`); `--both` runs the served rounds,
then the in-process ones, and sets the client's worst and p99 gaps against the in-process
ones round by round: whatever the client sees beyond the steps themselves came from outside
the engine step (frontend, postprocessing, streaming, the host).  `--profile` also records the
server over each served round and adds the gpu worker's own step gaps on the wall clock,
every process's longest collector pause, how long the worker waited for its core and how much
CPU the host's other processes took (`hops.py`), to say which hop a stall came from.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from tandem_serve.bench.stall.hops import HostMeter, Recorder, ServerSide, server_side
from tandem_serve.bench.stall.report import (
    Figures,
    arm_table,
    as_json,
    client_table,
    figures,
    frontier_table,
    ratio_table,
)
from tandem_serve.bench.stall.scenario import StallWorkload, run
from tandem_serve.harness.arms import beside_frontend
from tandem_serve.harness.server import serving

ARMS = ("mixed", "prefill-phase")


def arm_budget(arm: str, default: int) -> tuple[bool, int]:
    """(prefill phase, tokens per step; 0: the server's default) of an arm: "mixed",
    "mixed 128" (a `--budgets` arm) or "prefill-phase"."""
    if arm == "prefill-phase":
        return True, 0
    _, _, tokens = arm.partition(" ")
    return False, int(tokens) if tokens else default


def arm_names(args: argparse.Namespace) -> list[str]:
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"tandem bench stall: error: --arms: unknown {unknown}; "
                         f"choose from {list(ARMS)}")
    budgets = [b for b in args.budgets.split(",") if b]
    if not budgets or "mixed" not in arms:
        return arms
    if not all(b.isdigit() and int(b) > 0 for b in budgets):
        raise SystemExit(f"tandem bench stall: error: --budgets: {args.budgets!r} is not a "
                         "comma-separated list of positive token counts")
    return [f"mixed {b}" for b in budgets] + [a for a in arms if a != "mixed"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = StallWorkload()
    p.add_argument("--model", default="", help="model folder (default: the tiny model)")
    p.add_argument("--num-scheduler-steps", type=int, default=8)
    p.add_argument("--streams", type=int, default=w.streams, help="decoding streams")
    p.add_argument("--prompts", type=int, default=w.prompts, help="long prompts arriving")
    p.add_argument("--prompt-len", type=int, default=w.prompt_len, help="their tokens")
    p.add_argument("--interval", type=float, default=w.interval,
                   help="seconds between the long prompts' arrivals")
    p.add_argument("--rounds", type=int, default=3, help="scenario runs per arm, alternating")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="the mixed arm's tokens per step (0: the server's default)")
    p.add_argument("--budgets", default="",
                   help="comma-separated tokens per step: one mixed arm each (a sweep)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for every server (repeat, e.g. "
                        "--server-arg=--no-async-postproc)")
    p.add_argument("--in-process", action="store_true",
                   help="no servers: the scheduler and runner in this process, timed by the "
                        "worker's CPU time (the device's stalls, whatever else the host runs)")
    p.add_argument("--both", action="store_true",
                   help="the served rounds, then the in-process ones, and the client's gaps "
                        "against the in-process ones (what the client sees beyond the steps)")
    p.add_argument("--profile", action="store_true",
                   help="record the server over each served round: the gpu worker's own step "
                        "gaps (wall clock), each process's longest collector pause, the "
                        "worker's waits for its core and other processes' CPU beside the "
                        "client's figures")
    p.add_argument("--json", default="", help="write the figures here too")


def _progress(msg: str) -> None:
    print(f"[bench stall] {msg}", file=sys.stderr, flush=True)


def _report(results: dict[str, list[Figures]], arm: str, r: int) -> None:
    f = results[arm][-1]
    _progress(f"round {r + 1} {arm}: worst gap {f.worst_ratio:.1f}x median, "
              f"TTFT {f.ttft_ms:.0f} ms")


def _round(served: Any, tokenizer: Any, work: StallWorkload, seed: int,
           sides: list[ServerSide] | None) -> Figures:
    """One served round; with `sides`, the server's record of it appended there."""
    if sides is None:
        return figures(run(served.target, tokenizer, work, seed))
    # Past the streams' start (<1 s), the arrivals and the last prompt's first token.
    seconds = 1.5 + (work.prompts - 1) * work.interval + 3.0
    with Recorder(served.port, seconds) as rec, HostMeter(served.proc.pid) as host:
        stamps = run(served.target, tokenizer, work, seed)
    side = server_side(rec.result(), stamps.window)
    side.worker_wait_pct, side.others_cpu_pct = host.worker_wait_pct, host.others_cpu_pct
    sides.append(side)
    return figures(stamps)


def _served(args: argparse.Namespace, model: str, tokenizer: Any, work: StallWorkload,
            arms: list[str], sides: dict[str, list[ServerSide]] | None = None
            ) -> dict[str, list[Figures]]:
    shared = ["--num-scheduler-steps", str(args.num_scheduler_steps), *args.server_arg]
    results: dict[str, list[Figures]] = {arm: [] for arm in arms}
    with contextlib.ExitStack() as stack:
        servers = {}
        for arm in arms:
            phase, budget = arm_budget(arm, args.max_num_batched_tokens)
            flags = [*shared, "--max-new-tokens", "4096"]
            flags += ["--prefill-phase"] if phase else []
            flags += ["--max-num-batched-tokens", str(budget)] if budget else []
            servers[arm] = stack.enter_context(serving(model, flags, quiet=True))
            # Warm-up: first shapes of every kind (oneDNN builds a primitive per shape).
            run(servers[arm].target, tokenizer,
                StallWorkload(work.streams, 2, work.prompt_len, 0.5), 999)
            _progress(f"{arm} is up")
        for r in range(args.rounds):
            for arm in arms:
                arm_sides = None if sides is None else sides.setdefault(arm, [])
                # The client (a remote one in the real world) never takes the worker's core.
                with beside_frontend(servers[arm].proc.pid):
                    results[arm].append(_round(servers[arm], tokenizer, work, r, arm_sides))
                _report(results, arm, r)
    return results


def _in_process(args: argparse.Namespace, model: str, tokenizer: Any, work: StallWorkload,
                arms: list[str]) -> dict[str, list[Figures]]:
    from tandem_serve.bench.stall import inproc

    results: dict[str, list[Figures]] = {arm: [] for arm in arms}
    warm = StallWorkload(work.streams, 2, work.prompt_len, 0.5)
    for arm in arms:  # oneDNN's primitives per shape are built once per process
        inproc.run(model, tokenizer, warm, 999, args.num_scheduler_steps,
                   *arm_budget(arm, args.max_num_batched_tokens))
    for r in range(args.rounds):
        for arm in arms:
            phase, budget = arm_budget(arm, args.max_num_batched_tokens)
            stamps = inproc.run(model, tokenizer, work, r, args.num_scheduler_steps, phase,
                                budget)
            results[arm].append(figures(stamps))
            _report(results, arm, r)
    return results


def main(args: argparse.Namespace) -> int:
    from tandem_serve.harness.tiny_model import ensure_default_model
    from tandem_serve.tokenization.tokenizer import Tokenizer

    model = args.model or str(ensure_default_model(in_subprocess=True))
    tokenizer = Tokenizer.from_dir(model)
    work = StallWorkload(streams=args.streams, prompts=args.prompts, prompt_len=args.prompt_len,
                    interval=args.interval)
    arms = arm_names(args)
    if args.in_process and (args.both or args.profile):
        raise SystemExit("tandem bench stall: error: --in-process runs no server: drop it "
                         "for --both or --profile")
    sides: dict[str, list[ServerSide]] | None = {} if args.profile else None
    # Served first: the in-process rounds leave torch, a model and ~1 GB freed in this
    # process, which is the served rounds' client (one of its threads then held the GIL for
    # ~50 ms once a run, a stall of every stream it stamped).
    results = None if args.in_process else _served(args, model, tokenizer, work, arms, sides)
    inproc = _in_process(args, model, tokenizer, work, arms) \
        if args.in_process or args.both else None
    results = results if results is not None else inproc
    assert results is not None
    if args.both:
        assert inproc is not None
        print("In process (the worker's CPU clock):\n")
        print(arm_table(inproc))
        print("\nServed (the gRPC client's clock):\n")
    print(arm_table(results))
    if args.both or sides:
        print()
        print(client_table(results, inproc, sides))
    mixed = [a for a in arms if a != "prefill-phase"]
    if "prefill-phase" in arms:
        for arm in mixed:
            print()
            print(ratio_table(results, arm, "prefill-phase"))
        if len(mixed) > 1:
            print()
            print(frontier_table(results, mixed, "prefill-phase"))
    if args.json:
        settings = {**vars(args), "cpu_count": os.cpu_count()}
        settings.pop("func", None)
        data = as_json(results, settings)
        if args.both:
            assert inproc is not None
            data["in_process"] = as_json(inproc, {})["arms"]
        if sides:
            data["server_side"] = {arm: [asdict(s) for s in rounds]
                                   for arm, rounds in sides.items()}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0
