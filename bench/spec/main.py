"""`tandem bench spec`: speculative decoding against none, same model, same prompts.

For each mode (async K=8 and sync K=1 by default) one server per arm starts and stays up:
no speculation, and each `--spec-config`.  Then for every workload (copy-heavy, plain;
`workload.py`) and batch (the concurrency), the arms run the same requests back to back, in
an order that alternates from cell to cell and repeat to repeat, so a shared machine's drift
hits every arm.  Each run is read between two scrapes of the server's speculation counters
(`report.py` says what is computed from them).  Without `--model` the model is the copier
(`copier.py`), for which the copy-heavy prompts are its own greedy chain.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.workload import Workload
from tandem_serve.bench.spec import copier as copier_model
from tandem_serve.bench.spec.report import (
    COUNTERS,
    NONE,
    cell_key,
    run_figures,
    summarise,
    table,
    verdicts,
)
from tandem_serve.bench.spec.workload import WORKLOADS, build_items
from tandem_serve.harness.arms import ARM_READY_TIMEOUT_S, Arm, beside_frontend
from tandem_serve.harness.metrics_scrape import Scrape
from tandem_serve.harness.server import Served, serving


@dataclasses.dataclass(frozen=True)
class SpecPreset:
    batches: tuple[int, ...]
    waves: int  # requests per run: batch x waves, at least min_prompts
    min_prompts: int
    input_len: int
    output_len: int
    repeats: int


PRESETS = {"fast": SpecPreset((1, 32), 1, 4, 128, 32, 1),
           "default": SpecPreset((1, 8, 32), 4, 8, 256, 128, 2)}
# The speculative configs a name stands for; `draft_model`'s model comes from --draft-model.
SPEC_CONFIGS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}
MODES = {"async:8": Arm(8, True), "sync:1": Arm(1, False)}
# The scheduler reports its counters every 0.2 s: wait longer before reading them.
SETTLE_S = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--model", default="",
                   help="model folder (default: the copier built from the tiny model)")
    p.add_argument("--spec-config", action="append", default=[],
                   help="a speculative arm: a name (" + ", ".join(SPEC_CONFIGS) + ") or "
                        "--speculative-config's JSON; repeatable (default: ngram)")
    p.add_argument("--draft-model", default="",
                   help="the draft_model arm's draft (default with the copier: its first "
                        "layer alone)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated, of " + ", ".join(MODES) + " (MODE:K)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default="", help="comma-separated concurrencies (preset's)")
    p.add_argument("--input-len", type=int, default=0, help="prompt tokens (preset's)")
    p.add_argument("--output-len", type=int, default=0, help="output tokens (preset's)")
    p.add_argument("--repeats", type=int, default=0, help="runs per cell (preset's)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per run (0: the preset's, max(minimum, batch x waves))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every server (repeatable)")
    p.add_argument("--json", default="", help="write the settings, runs and table here too")


def _progress(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: expected integers >= 1, got {text!r}")
    return values


def spec_arms(names: list[str], draft: str) -> dict[str, str]:
    """Arm name -> --speculative-config JSON, for each named or JSON config."""
    arms = {}
    for text in names or ["ngram"]:
        if text in SPEC_CONFIGS:
            cfg = dict(SPEC_CONFIGS[text])
        else:
            try:
                cfg = json.loads(text)
            except json.JSONDecodeError:
                raise SystemExit(f"--spec-config: {text!r} is neither a name ("
                                 f"{', '.join(SPEC_CONFIGS)}) nor JSON") from None
            if not isinstance(cfg, dict):
                raise SystemExit(f"--spec-config: {text!r} is not a JSON object")
        if cfg.get("method") == "draft_model" and "model" not in cfg:
            if not draft:
                raise SystemExit("--spec-config draft_model needs --draft-model DIR")
            cfg["model"] = draft
        name = f"{cfg.get('method')} k={cfg.get('num_speculative_tokens')}"
        if "model" in cfg:
            name += f" ({os.path.basename(str(cfg['model']).rstrip('/'))})"
        arms[name] = json.dumps(cfg)
    return arms


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes: the preset's, with any flag given on top; errors name the flag."""
    p = PRESETS[args.preset]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    kinds = [w for w in args.workloads.split(",") if w]
    for w in kinds:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown {w!r}; choose from {', '.join(WORKLOADS)}")
    for flag in ("input_len", "output_len", "repeats", "requests"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be >= 1 (0: the preset's)")
    return {"preset": args.preset, "modes": modes, "workloads": kinds,
            "batches": _ints(args.batches, "--batches") if args.batches else p.batches,
            "input_len": args.input_len or p.input_len,
            "output_len": args.output_len or p.output_len,
            "repeats": args.repeats or p.repeats, "waves": p.waves,
            "min_prompts": p.min_prompts, "requests": args.requests, "seed": args.seed}


def num_prompts(s: dict[str, Any], batch: int) -> int:
    return s["requests"] or max(s["min_prompts"], batch * s["waves"])


def counters(served: Served) -> dict[str, float]:
    scrape = Scrape(f"http://127.0.0.1:{served.http_port}/metrics")
    return {k: scrape.total(name) for k, name in COUNTERS.items()}


def measure(served: Served, model: str, work: Workload, batch: int) -> dict[str, Any]:
    time.sleep(SETTLE_S)
    before = counters(served)
    result = work.run(port=served.port, model=model, max_concurrency=batch)
    time.sleep(SETTLE_S)
    if result.get("failed"):
        raise RuntimeError(f"{result['failed']} requests failed: "
                           f"{[e for e in result.get('errors', []) if e][:1]}")
    return run_figures(result, before, counters(served))


def _works(model: str, copier: bool, s: dict[str, Any]) -> dict[tuple[str, int], Workload]:
    from tandem_serve.bench.serve.run import load_tokenizer

    bench = BenchConfig(model=model, input_len=s["input_len"], output_len=s["output_len"],
                        seed=s["seed"])
    tok = load_tokenizer(bench)
    works = {}
    for kind in s["workloads"]:
        most = build_items(kind, model, copier, tok, num_prompts(s, max(s["batches"])),
                           s["input_len"], s["output_len"], s["seed"])
        for b in s["batches"]:
            works[kind, b] = Workload(bench, most[:num_prompts(s, b)], [], tok)
    return works


def _warm(served: Served, model: str, works: dict[tuple[str, int], Workload]) -> None:
    """Every workload at its largest batch with 4-token outputs: the shapes of the runs are
    built before any run is timed."""
    for (kind, b), work in works.items():
        if b == max(bb for k, bb in works if k == kind):
            items = [dataclasses.replace(i, output_len=4) for i in work.items]
            dataclasses.replace(work, items=items).run(port=served.port, model=model,
                                                       max_concurrency=b)


def start_all(stack: contextlib.ExitStack, model: str, flags: dict[str, list[str]]
              ) -> dict[str, Served]:
    """A server per arm, started at once (a GPU host's starts are long and mostly waiting),
    each stopped by `stack`; the first error once every start has ended."""
    managers = {name: serving(model, f, http=True, quiet=True, timeout=ARM_READY_TIMEOUT_S)
                for name, f in flags.items()}
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = {name: pool.submit(cm.__enter__) for name, cm in managers.items()}
    servers, errors = {}, []
    for name, future in futures.items():
        try:
            servers[name] = future.result()
            stack.push(managers[name].__exit__)
        except Exception as exc:  # the others still get stopped by the stack
            errors.append(exc)
    if errors:
        raise errors[0]
    return servers


def run_mode(mode: str, model: str, arms: dict[str, str], extra: list[str],
             works: dict[tuple[str, int], Workload], repeats: int,
             runs: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Every arm's server of `mode` up at once, then every cell on each, alternating."""
    base = MODES[mode]
    with contextlib.ExitStack() as stack:
        servers = start_all(stack, model, {
            name: [*base.flags, *(["--speculative-config", cfg] if cfg else []), *extra]
            for name, cfg in arms.items()})
        for name, served in servers.items():
            _warm(served, model, works)
            _progress(f"{base.name}, {name}: up")
        order = list(arms)
        with beside_frontend(next(iter(servers.values())).proc.pid):
            for rep in range(repeats):
                for i, (kind, b) in enumerate(works):
                    for name in order if (rep + i) % 2 == 0 else order[::-1]:
                        fig = measure(servers[name], model, works[kind, b], b)
                        runs.setdefault(cell_key(base.name, kind, b), {}).setdefault(
                            name, []).append(fig)
                        _progress(f"{rep + 1}/{repeats} {base.name} {kind} batch {b} {name}: "
                                  f"TPOT p50 {fig['median_tpot_ms']:.2f} ms, "
                                  f"{fig['output_throughput']:.0f} tok/s")


def main(args: argparse.Namespace) -> int:
    s = settings(args)
    copier = not args.model or (Path(args.model) / copier_model.MARKER).exists()
    model = args.model or str(copier_model.ensure_copier())
    draft = args.draft_model
    if not draft and copier and "draft_model" in args.spec_config:
        draft = str(copier_model.ensure_copier_draft())
    arms = {NONE: "", **spec_arms(list(args.spec_config), draft)}
    works = _works(model, copier, s)
    _progress(f"model {model} ({'copier' if copier else 'given'}); arms: {', '.join(arms)}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for mode in s["modes"]:
        run_mode(mode, model, arms, list(args.server_arg), works, s["repeats"], runs)
    rows = summarise(runs, list(arms))
    print(table(rows))
    lines = verdicts(rows)
    if lines:
        print()
        print("\n".join(f"- {line}" for line in lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {**s, "model": model, "copier": copier, "arms": arms,
                                    "cpu_count": os.cpu_count()},
                       "rows": rows, "runs": runs, "verdicts": lines}, f, indent=1)
    return 0
