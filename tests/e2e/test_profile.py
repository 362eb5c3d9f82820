"""`tandem profile` against a real server under load: lanes, clock agreement, summary."""
from __future__ import annotations

import pathlib
import threading

import pytest

from rpc import profile_report
from rpc.client import GenerateOptions
from rpc.profile_cli import record
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def test_profile_under_load(fast_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    server = Server(str(fast_model_dir), "--num-scheduler-steps", "4").wait_ready()
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            list(server.client.stream("profile me please", GenerateOptions(max_new_tokens=40)))

    threads = [threading.Thread(target=load) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        profiles = record("127.0.0.1", server.port, 2.0).profiles
    finally:
        stop.set()
        for t in threads:
            t.join()
        assert server.stop() == 0
    roles = {p["role"] for p in profiles}
    assert {"frontend", "scheduler", "gpu-worker", "postproc 0", "postproc 1"} == roles
    worker = next(p for p in profiles if p["role"] == "gpu-worker")
    forward_end = {(s[3], s[4]): s[2] for s in worker["spans"] if s[0] == "forward"}
    assert len(forward_end) >= 8
    checked = 0
    for p in profiles:
        for name, start, end, plan, step in p["spans"]:
            assert start <= end
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


def test_metrics_endpoint_fills_histograms(fast_model_dir: pathlib.Path) -> None:
    import urllib.request

    from tests.e2e.server import free_port

    port = free_port()
    server = Server(str(fast_model_dir), "--metrics-port", str(port)).wait_ready()
    try:
        for _ in range(3):
            list(server.client.stream("metrics please", GenerateOptions(max_new_tokens=6)))
        import time

        time.sleep(0.5)  # the scheduler's counters arrive every 0.2 s
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    finally:
        assert server.stop() == 0

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[-1])

    assert value("tandem_time_to_first_token_seconds_count") >= 4  # warm-up + 3
    assert value("tandem_inter_token_latency_seconds_count") >= 15
    assert value("tandem_e2e_request_latency_seconds_count") >= 4
    assert 0.0 < value("tandem_device_busy_ratio") <= 1.0
    assert 'tandem_requests_total{reason="MAX_TOKENS"}' in text
