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
- restart: the compose roles started one by one (`roles.py`), one role killed and started
  again as compose's restart policy would: how long the frontend was NOT_SERVING.

The end-to-end tests drive the same client patterns at a small size.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from tandem_serve.bench.robustness.parts import run_overload, run_restart, run_stalled, run_vanish

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
