"""The profile merge: summary numbers, trace structure and picture on synthetic spans."""
from __future__ import annotations

import json
import pathlib

import pytest

from tandem_serve.ipc.tracing import Tracer
from tandem_serve.tandem import profile_report as pr

MS = 1_000_000


def synthetic() -> list[dict]:
    # Worker: 4 steps of 10 ms forward, 2 ms gap, over [0, 48) ms.
    worker = [("forward", i * 12 * MS, i * 12 * MS + 10 * MS, 1, i) for i in range(4)]
    # Postproc: detokenize step i for 4 ms right after its forward ends; 2 ms of it overlap
    # the next forward (which starts 2 ms after the end), the last one none.
    post = [("detokenize", i * 12 * MS + 10 * MS, i * 12 * MS + 14 * MS, 1, i)
            for i in range(4)]
    base = {"started_ns": 0, "stopped_ns": 50 * MS, "counters": []}
    return [{**base, "role": "gpu-worker", "spans": worker},
            {**base, "role": "postproc 0", "spans": post,
             "counters": [["lag_steps", 5 * MS, 1.0], ["lag_steps", 6 * MS, 3.0]]},
            {**base, "role": "scheduler", "spans": [("plan", 0, MS, 1, -1)]}]


def test_summary_numbers_match_the_trace() -> None:
    s = pr.summarize(synthetic())
    assert s.window_ms == pytest.approx(50)
    assert s.num_steps == 4
    assert s.device_busy_pct == pytest.approx(80)  # 40 ms of 50
    assert s.step_gap_mean_ms == pytest.approx(2) and s.step_gap_p99_ms == pytest.approx(2)
    # 3 of 4 detokenize spans overlap the next forward by 2 ms: 6 ms of 16.
    assert s.postproc_overlap_pct == pytest.approx(100 * 6 / 16)
    assert s.postproc_lag_steps_max == 3
    worker = next(p for p in s.processes if p.role == "gpu-worker")
    assert worker.spans["forward"].count == 4
    assert worker.spans["forward"].total_ms == pytest.approx(40)
    assert worker.busy_pct == pytest.approx(80)
    text = pr.format_summary(s)
    assert "device busy 80.0%" in text and "detokenize" in text


def test_chrome_trace_has_lanes_and_flows(tmp_path: pathlib.Path) -> None:
    trace = pr.chrome_trace(synthetic())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"tandem: gpu-worker", "tandem: postproc 0", "tandem: scheduler"}
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 4
    # An arrow never points back in time.
    for s, f in zip(starts, finishes, strict=True):
        assert s["id"] == f["id"] and s["ts"] <= f["ts"]
    json.dumps(trace)


def test_png_is_written(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.png"
    pr.timeline_png(synthetic(), str(path), window_ms=50)
    assert path.stat().st_size > 1000


def test_tracer_off_records_nothing_and_on_records_spans() -> None:
    t = Tracer("x")
    with t.span("a"):
        pass
    assert not t.spans
    t.start()
    with t.span("a", plan=3, step=1):
        pass
    t.counter("depth", 2)
    data = t.stop()
    assert data["spans"][0][0] == "a" and data["spans"][0][3:] == [3, 1]
    assert data["counters"][0][2] == 2
    assert data["spans"][0][1] <= data["spans"][0][2]


def test_frontend_spans_name_their_request() -> None:
    frontend = {"role": "frontend", "started_ns": 0, "stopped_ns": 50 * MS, "counters": [],
                "spans": [("tokenize", MS, 2 * MS, -1, 77), ("route", 3 * MS, 4 * MS, -1, -1)]}
    events = pr.chrome_trace([*synthetic(), frontend])["traceEvents"]
    tok = next(e for e in events if e["name"] == "tokenize")
    assert tok["args"] == {"request": 77}
    assert next(e for e in events if e["name"] == "route")["args"] == {"plan": -1, "step": -1}
    s = pr.summarize([*synthetic(), frontend])
    assert next(p for p in s.processes if p.role == "frontend").busy_pct == pytest.approx(4)
