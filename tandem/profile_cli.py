"""`tandem profile`: record every process of a running server, then merge and show it.

    tandem profile --duration 5 --output trace.json --png timeline.png
    tandem profile --plans 20 --output trace.json
    tandem profile --plans 20 --torch-profiler torch.json
    tandem profile --duration 20 -- bench serve --num-prompts 64 --input-len 128

`--plans N` records until the gpu worker has finished N plans after the start (`--duration`
is then the upper bound).  `--torch-profiler FILE` has the gpu worker run torch.profiler over
the same window and write its Chrome trace to FILE, on the worker's host.  The last form runs
a workload (any `tandem` subcommand) while recording: recording starts a second into it, so
the window shows steady state.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc

from tandem_serve.ipc.process import CLI
from tandem_serve.proto import admin_pb2, admin_pb2_grpc
from tandem_serve.rpc.client import make_channel
from tandem_serve.tandem import profile_report

DEFAULT_DURATION = 5.0  # seconds, when neither --duration nor --plans is given
PLANS_DEADLINE = 120.0  # upper bound for --plans without --duration (an idle server)


@dataclass
class Recording:
    profiles: list[dict]
    plans: int  # plans the gpu worker finished inside the window
    torch_trace: str
    torch_error: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8033)
    p.add_argument("--api-key", default="", help="the server's --api-key (the admin service "
                   "needs it when one is set)")
    p.add_argument("--duration", type=float, default=None,
                   help=f"seconds to record (default {DEFAULT_DURATION:g}; with --plans the "
                        f"upper bound, default {PLANS_DEADLINE:g})")
    p.add_argument("--plans", type=int, default=0,
                   help="record until the gpu worker has finished this many plans")
    p.add_argument("--torch-profiler", default="", metavar="FILE",
                   help="the gpu worker also runs torch.profiler and writes its trace here")
    p.add_argument("--output", default="", help="Chrome/Perfetto trace JSON to write")
    p.add_argument("--png", default="", help="timeline picture of a short window")
    p.add_argument("--png-window-ms", type=float, default=200.0)
    p.add_argument("--png-centre", default="forward", metavar="SPAN",
                   help="centre the picture on the gpu worker's median span of this name "
                        "(e.g. prefill, to see what decoding rows wait for)")
    p.add_argument("--summary-json", default="", help="the summary as JSON")
    p.add_argument("workload", nargs=argparse.REMAINDER,
                   help="-- tandem subcommand to run while recording (e.g. bench serve ...)")


def record(host: str, port: int, duration: float, plans: int = 0,
           torch_trace: str = "", api_key: str = "") -> Recording:
    channel = make_channel(f"{host}:{port}", api_key=api_key)
    try:
        stub = admin_pb2_grpc.AdminStub(channel)
        req = admin_pb2.ProfileRequest(duration_s=duration, plans=plans,
                                       torch_trace_path=torch_trace)
        # The exporting of a torch trace and a plan in flight come on top of the window.
        resp = stub.Profile(req, timeout=duration + 60)
        return Recording(list(json.loads(resp.profiles_json)), resp.plans_recorded,
                         resp.torch_trace_path, resp.torch_trace_error)
    finally:
        channel.close()


def _start_workload(args: argparse.Namespace) -> subprocess.Popen | None:
    workload = [a for a in args.workload if a != "--"]
    if not workload:
        return None
    cmd = [*CLI, *workload]
    if "--port" not in workload and workload[:2] == ["bench", "serve"]:
        cmd += ["--port", str(args.port)]
    proc = subprocess.Popen(cmd)
    time.sleep(1.0)
    return proc


def _window(args: argparse.Namespace) -> tuple[float, str]:
    """Upper bound in seconds, and how the window is described."""
    if args.plans:
        duration = args.duration or PLANS_DEADLINE
        return duration, f"until the gpu worker has finished {args.plans} plans " \
                         f"(at most {duration:g} s)"
    duration = args.duration or DEFAULT_DURATION
    return duration, f"{duration:g} s"


def _say(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def _report(rec: Recording, args: argparse.Namespace) -> None:
    _say(f"the gpu worker finished {rec.plans} plans inside the window")
    if args.plans and rec.plans < args.plans:
        _say(f"the time limit came before {args.plans} plans (is the server busy?)")
    if rec.torch_trace:
        _say(f"torch.profiler trace: {rec.torch_trace} (written by the gpu worker)")
    elif args.torch_profiler:
        _say(f"torch.profiler trace not written: {rec.torch_error or 'no reason given'}")
    summary = profile_report.summarize(rec.profiles)
    print(profile_report.format_summary(summary))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(profile_report.chrome_trace(rec.profiles), f)
        _say(f"trace: {args.output} (open in ui.perfetto.dev or chrome://tracing)")
    if args.png:
        profile_report.timeline_png(rec.profiles, args.png, args.png_window_ms,
                                    centre=args.png_centre)
        _say(f"timeline: {args.png}")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(dataclasses.asdict(summary), f, indent=2)


def main(args: argparse.Namespace) -> int:
    if args.plans < 0:
        _say("--plans must be >= 0")
        return 2
    duration, what = _window(args)
    # The gpu worker writes the file, from its own working folder: the path must be absolute.
    torch_trace = os.path.abspath(args.torch_profiler) if args.torch_profiler else ""
    proc = _start_workload(args)
    _say(f"recording {what} ...")
    try:
        rec = record(args.host, args.port, duration, args.plans, torch_trace, args.api_key)
    except grpc.RpcError as exc:  # the server's own words say what went wrong
        _say(f"failed: {exc.code().name}: {exc.details()}")
        return 1
    finally:
        if proc is not None:
            proc.wait()
    _report(rec, args)
    return 0
