"""The parts of `tandem bench robustness`, each on its own server (or set of compose roles):
what it drives, what it measures, and the line it prints."""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from typing import Any

from tandem_serve.harness.clients import (
    WORDS,
    burst,
    detailed,
    finish_stalled,
    overload_jobs,
    stalled_streams,
    summarize_overload,
    vanish,
)
from tandem_serve.harness.processes import rss_kb
from tandem_serve.harness.roles import RoleSet, wait_health, wait_serving_anew
from tandem_serve.harness.server import serving, wait_idle


def run_overload(args: argparse.Namespace) -> dict[str, Any]:
    q, s = args.max_queued_requests, args.max_num_seqs
    with serving(args.model, ["--max-queued-requests", str(q), "--max-num-seqs", str(s)]) as sv:
        n = 10 * (q + s)
        report = summarize_overload(burst(sv.target, overload_jobs(n, args.tokens, WORDS[:8])),
                                    args.tokens)
    print(f"overload: burst of {report.sent} (10x {q} queued + {s} running) → admitted "
          f"{report.admitted}, rejected {report.rejected} (RESOURCE_EXHAUSTED before any "
          f"response), lost {report.lost}, admitted but incomplete {report.incomplete}; "
          f"TTFT of the admitted p50 {report.ttft_p50_s * 1e3:.0f} ms, p99 "
          f"{report.ttft_p99_s * 1e3:.0f} ms")
    if report.rejection:
        print(f"  rejection: {report.rejection}")
    return asdict(report)


SETTLE_S = 5.0


def stalled_arm(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    from tandem_serve.rpc.client import GenerateOptions

    with serving(args.model, ["--max-stream-buffer-bytes", str(limit),
                              "--max-new-tokens", "2000"]) as sv:
        client = sv.client
        list(client.stream("warm", detailed(64)))  # allocator pools before the baseline
        time.sleep(SETTLE_S)  # the frontend gives back start-up memory for a while
        before = rss_kb(sv.proc.pid) or 0
        with stalled_streams(sv.target, args.stalled, args.stall_tokens) as calls:
            # Cancelled (with a limit) or finished (without): nothing runs any more.
            idle = wait_idle(client, timeout=600)
            during = rss_kb(sv.proc.pid) or 0
            t0 = time.monotonic()
            other = list(client.stream("Meanwhile", GenerateOptions(max_new_tokens=64,
                                                                    min_new_tokens=64)))
            other_s = time.monotonic() - t0
            outs = finish_stalled(calls)
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
        r = arms[str(limit)] = stalled_arm(args, limit)
        print(f"stalled, --max-stream-buffer-bytes {limit}{' (no limit)' if not limit else ''}:"
              f" {r['stalled']} clients stopped reading {args.stall_tokens}-token detailed "
              f"streams → {r['cancelled']} cancelled; frontend RSS "
              f"{r['frontend_rss_before_mb']:.1f} MB idle, {r['frontend_rss_stalled_mb']:.1f} MB "
              f"with them all stalled ({r['frontend_growth_mb']:+.1f} MB); a reading client got "
              f"its {r['other_stream_tokens']} tokens in {r['other_stream_s']:.2f} s meanwhile")
    return arms


def run_vanish(args: argparse.Namespace) -> dict[str, Any]:
    with serving(args.model, ["--max-num-seqs", str(max(64, args.vanish))]) as sv:
        errors = vanish(sv.target, args.vanish, 1000)
        s = wait_idle(sv.client)
    out = {"clients": args.vanish, "errors": errors,
           "blocks_leaked": s.num_total_blocks - s.num_free_blocks,
           "running": s.num_running, "waiting": s.num_waiting}
    print(f"vanish: {args.vanish} clients disconnected mid-stream (half cancel, half close "
          f"the connection) → {out['blocks_leaked']} KV blocks leaked, {s.num_running} "
          f"running, {s.num_waiting} waiting{'; errors: ' + str(errors) if errors else ''}")
    return out


def restart_one(roles: Any, client: Any, role: str) -> dict[str, Any]:
    """Kill `role` (SIGKILL) and time the set's way back; the frontend must stay unless it
    is the one killed."""
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
    """The compose roles (`roles.py`), each role killed in turn."""
    from tandem_serve.rpc.client import TandemClient

    model = args.model
    if not model:
        from tandem_serve.harness.tiny_model import ensure_default_model

        model = str(ensure_default_model(in_subprocess=True))
    roles = RoleSet(model, tempfile.mkdtemp(prefix="tandem-roles-"))
    roles.start_all()
    roles.restart_policy()
    client = TandemClient(roles.target)
    results = []
    try:
        wait_health(client, True, 600, roles.procs["frontend"])
        for role in ("scheduler", "gpu-worker", "postproc-0", "frontend"):
            r = restart_one(roles, client, role)
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
