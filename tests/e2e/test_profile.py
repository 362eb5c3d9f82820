"""`tandem profile` against a real server under load: lanes, nesting, clock agreement, the
plan-count window, torch.profiler, and the metrics endpoint."""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from tandem_serve.ipc.process import CLI
from tandem_serve.ipc.tracing import GC_SPANS
from tandem_serve.rpc.client import GenerateOptions
from tandem_serve.tandem import profile_cli, profile_report
from tandem_serve.tandem.profile_cli import record
from tests.e2e.server import ROOT, Server, free_port

pytestmark = pytest.mark.slow

ROLES = {"frontend", "scheduler", "gpu-worker", "postproc 0", "postproc 1"}
EPS_US = 0.002  # trace times are µs floats from integer ns; a zero-length span shows as 1 ns


@pytest.fixture(scope="module")
def server(fast_model_dir: pathlib.Path) -> Iterator[Server]:
    srv = Server(str(fast_model_dir), "--num-scheduler-steps", "4",
                 "--metrics-port", str(free_port())).wait_ready()
    try:
        yield srv
    finally:
        assert srv.stop() == 0
        assert not srv.leftovers()


def metrics_port(server: Server) -> int:
    args = server.proc.args
    assert isinstance(args, list)
    return int(args[args.index("--metrics-port") + 1])


@contextmanager
def load(server: Server, streams: int = 6, tokens: int = 40) -> Iterator[None]:
    """Streams back to back on `streams` threads while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            list(server.client.stream("profile me please", GenerateOptions(max_new_tokens=tokens)))

    threads = [threading.Thread(target=run) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)  # past the first prefills: steady decoding
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_profile_under_load(server: Server, tmp_path: pathlib.Path) -> None:
    with load(server):
        profiles = record("127.0.0.1", server.port, 2.0).profiles
    assert {p["role"] for p in profiles} == ROLES
    worker = next(p for p in profiles if p["role"] == "gpu-worker")
    forward_end = {(s[3], s[4]): s[2] for s in worker["spans"] if s[0] == "forward"}
    assert len(forward_end) >= 8
    checked = 0
    for p in profiles:
        for name, start, end, plan, step in p["spans"]:
            assert p["started_ns"] <= start <= end <= p["stopped_ns"]
            if p["role"].startswith("postproc") and name == "detokenize" \
                    and (plan, step) in forward_end:
                # One clock for every process: tokens are never handled before they exist.
                assert start >= forward_end[(plan, step)]
                checked += 1
    assert checked > 0
    summary = profile_report.summarize(profiles)
    assert summary.num_steps == len([s for s in worker["spans"] if s[0] == "forward"])
    fwd = next(p for p in summary.processes if p.role == "gpu-worker").spans["forward"]
    assert fwd.total_ms == pytest.approx(
        sum(s[2] - s[1] for s in worker["spans"] if s[0] == "forward") / 1e6)
    trace = profile_report.chrome_trace(profiles)
    lanes = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len(lanes) == 5
    profile_report.timeline_png(profiles, str(tmp_path / "t.png"))


# ---------------------------------------------------------------------- the CLI, --plans 20


def lanes(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Role -> its complete ("X") events, from the Chrome trace."""
    names = {e["pid"]: e["args"]["name"].removeprefix("tandem: ")
             for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, list[dict[str, Any]]] = {role: [] for role in names.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[names[e["pid"]]].append(e)
    return out


def assert_nested_or_disjoint(role: str, events: list[dict[str, Any]]) -> None:
    stack: list[tuple[float, str]] = []  # ends of the open spans
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= start + EPS_US:
            stack.pop()
        if stack:  # starts inside an open span: must end inside it too
            assert end <= stack[-1][0] + EPS_US, \
                f"{role}: {e['name']} at {start} µs overlaps {stack[-1][1]} ending {stack[-1][0]}"
        stack.append((end, e["name"]))


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, cur = 0.0, None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = (s, e)
        else:
            cur = (cur[0], max(cur[1], e))
    return (total + (cur[1] - cur[0] if cur else 0.0)) / 1e3


def test_profile_cli_records_twenty_plans(server: Server, tmp_path: pathlib.Path) -> None:
    trace_path, summary_path = tmp_path / "trace.json", tmp_path / "summary.json"
    with load(server):
        run = subprocess.run(
            [*CLI, "profile", "--port", str(server.port),
             "--plans", "20", "--duration", "90", "--output", str(trace_path),
             "--summary-json", str(summary_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert "the gpu worker finished 20 plans" in run.stderr
    assert "20 plans" in run.stdout  # the summary's first line
    by_role = lanes(json.loads(trace_path.read_text()))
    summary = json.loads(summary_path.read_text())

    # Every process has a lane with work in it.
    assert set(by_role) == ROLES
    for role, events in by_role.items():
        assert events, f"{role} recorded nothing"
        assert_nested_or_disjoint(role, events)
    frontend = {e["name"] for e in by_role["frontend"]}
    assert {"validate", "tokenize", "stream_write", "route"} <= frontend

    # The worker stopped itself after exactly 20 whole plans (collections have no plan).
    worker = [e for e in by_role["gpu-worker"] if e["name"] not in GC_SPANS]
    plans = {e["args"]["plan"] for e in worker}
    assert len(plans) == 20 and summary["num_plans"] == 20
    assert {e["args"]["plan"] for e in worker if e["name"] == "apply"} == plans

    # One clock: no postproc span of a step starts before that step's forward has ended.
    forward_end = {(e["args"]["plan"], e["args"]["step"]): e["ts"] + e["dur"]
                   for e in worker if e["name"] == "forward"}
    checked = 0
    for role in ("postproc 0", "postproc 1"):
        for e in by_role[role]:
            key = (e["args"].get("plan"), e["args"].get("step"))
            if key in forward_end:
                assert e["ts"] >= forward_end[key] - EPS_US, (role, e)
                checked += 1
    assert checked > 0

    # The summary's numbers are the trace's.
    assert summary["num_steps"] == len(forward_end)
    procs = {p["role"]: p for p in summary["processes"]}
    fwd = procs["gpu-worker"]["spans"]["forward"]
    assert fwd["count"] == len(forward_end)
    assert fwd["total_ms"] == pytest.approx(
        sum(e["dur"] for e in worker if e["name"] == "forward") / 1e3, rel=1e-6)
    device = [(e["ts"], e["ts"] + e["dur"]) for e in worker
              if e["name"] in profile_report.DEVICE_SPANS]
    assert summary["device_busy_pct"] == pytest.approx(
        100 * union_ms(device) / summary["window_ms"], abs=0.01)
    for role, events in by_role.items():
        busy = [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e["name"] not in profile_report.NOT_BUSY]
        assert procs[role]["busy_pct"] == pytest.approx(
            100 * union_ms(busy) / summary["window_ms"], abs=0.01), role
    assert procs["frontend"]["busy_pct"] > 0


# ---------------------------------------------------------------------- torch.profiler


def test_torch_profiler_trace_written_by_the_worker(server: Server, tmp_path: pathlib.Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    # A relative path, as a user types it: the CLI makes it absolute for the worker.
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["--port", str(server.port), "--plans", "3", "--duration", "60",
                              "--torch-profiler", "torch/trace.json"])
    with load(server, streams=2):
        assert profile_cli.main(args) == 0
    path = tmp_path / "torch" / "trace.json"
    assert f"torch.profiler trace: {path}" in capsys.readouterr().err
    events = json.loads(path.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)


def test_profile_rejects_a_relative_torch_path_and_a_second_recording(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        record("127.0.0.1", server.port, 1.0, torch_trace="trace.json")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    first = threading.Thread(target=record, args=("127.0.0.1", server.port, 2.0))
    first.start()
    time.sleep(0.5)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            record("127.0.0.1", server.port, 1.0)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        first.join()


# ---------------------------------------------------------------------- metrics


def test_metrics_endpoint_fills_histograms(server: Server) -> None:
    for _ in range(3):
        list(server.client.stream("metrics please", GenerateOptions(max_new_tokens=6)))
    with load(server, streams=4, tokens=20):
        time.sleep(1.0)
    time.sleep(0.5)  # the scheduler's counters arrive every 0.2 s
    port = metrics_port(server)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[-1])

    assert value("tandem_time_to_first_token_seconds_count") >= 4  # warm-up + 3
    assert value("tandem_inter_token_latency_seconds_count") >= 15
    assert value("tandem_e2e_request_latency_seconds_count") >= 4
    assert 0.0 < value("tandem_device_busy_ratio") <= 1.0
    assert 'tandem_requests_total{reason="MAX_TOKENS"}' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length"' in text
    # Every request is scheduled once, and every one has ended: as many queue times as
    # first tokens.
    queued = value("tandem_queue_time_seconds_count")
    assert queued == value("tandem_time_to_first_token_seconds_count")
    assert value("tandem_queue_time_seconds_sum") >= 0
    assert value('tandem_queue_time_seconds_bucket{le="+Inf"}') == queued
    assert value("tandem_postproc_lag_steps") >= 0  # present; its size depends on the load


def test_a_recording_the_client_gave_up_on_leaves_nobody_recording(
        server: Server, tmp_path: pathlib.Path) -> None:
    from tandem_serve.proto import admin_pb2, admin_pb2_grpc
    from tandem_serve.rpc.client import make_channel

    torch_trace = tmp_path / "abandoned.json"
    channel = make_channel(f"127.0.0.1:{server.port}")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            admin_pb2_grpc.AdminStub(channel).Profile(
                admin_pb2.ProfileRequest(duration_s=60, torch_trace_path=str(torch_trace)),
                timeout=1.0)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        channel.close()
    # The frontend told every process to stop at once: the worker's torch.profiler run ends
    # and its file appears now, not after the 60 s nobody waits for any more.
    deadline = time.monotonic() + 20
    while not torch_trace.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert torch_trace.exists()
    with load(server, streams=2):
        rec = record("127.0.0.1", server.port, 1.0)
    assert {p["role"] for p in rec.profiles} == ROLES
