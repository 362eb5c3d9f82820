"""`tandem profile`: record every process of a running server, then merge and show it.

    tandem profile --duration 5 --output trace.json --png timeline.png
    tandem profile --duration 20 -- bench serve --num-prompts 64 --input-len 128

The second form runs a workload (any `tandem` subcommand) while recording: recording starts
a second into it, so the window shows steady state.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from proto import admin_pb2, admin_pb2_grpc
from rpc import profile_report
from rpc.client import make_channel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8033)
    p.add_argument("--duration", type=float, default=5.0, help="seconds to record")
    p.add_argument("--output", default="", help="Chrome/Perfetto trace JSON to write")
    p.add_argument("--png", default="", help="timeline picture of a short window")
    p.add_argument("--png-window-ms", type=float, default=200.0)
    p.add_argument("--summary-json", default="", help="the summary as JSON")
    p.add_argument("workload", nargs=argparse.REMAINDER,
                   help="-- tandem subcommand to run while recording (e.g. bench serve ...)")


def record(host: str, port: int, duration: float) -> list[dict]:
    channel = make_channel(f"{host}:{port}")
    try:
        stub = admin_pb2_grpc.AdminStub(channel)
        resp = stub.Profile(admin_pb2.ProfileRequest(duration_s=duration),
                            timeout=duration + 60)
        return list(json.loads(resp.profiles_json))
    finally:
        channel.close()


def main(args: argparse.Namespace) -> int:
    workload = [a for a in args.workload if a != "--"]
    proc = None
    if workload:
        cmd = [sys.executable, "-m", "rpc.cli", *workload]
        if "--port" not in workload and workload[:2] == ["bench", "serve"]:
            cmd += ["--port", str(args.port)]
        proc = subprocess.Popen(cmd)
        time.sleep(1.0)
    print(f"[profile] recording {args.duration:.1f} s ...", file=sys.stderr, flush=True)
    result: dict[str, list[dict]] = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "p", record(args.host, args.port, args.duration)))
    t.start()
    t.join()
    profiles = result["p"]
    if proc is not None:
        proc.wait()
    summary = profile_report.summarize(profiles)
    print(profile_report.format_summary(summary))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(profile_report.chrome_trace(profiles), f)
        print(f"[profile] trace: {args.output} (open in ui.perfetto.dev or chrome://tracing)",
              file=sys.stderr)
    if args.png:
        profile_report.timeline_png(profiles, args.png, args.png_window_ms)
        print(f"[profile] timeline: {args.png}", file=sys.stderr)
    if args.summary_json:
        import dataclasses

        with open(args.summary_json, "w") as f:
            json.dump(dataclasses.asdict(summary), f, indent=2)
    return 0
