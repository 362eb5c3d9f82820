"""Merge per-process span recordings into a Chrome/Perfetto trace, a summary and a picture.

Input: one dict per process as `ipc.tracing.Tracer.stop()` returns it (role, spans as
(name, start_ns, end_ns, plan, step), counters).  Every process used the same monotonic
clock, so the merge is a plain union; the device's busy time is the union of the gpu
worker's compute spans, and "overlap" is how much postprocessing ran inside it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEVICE_SPANS = ("prefill", "forward", "sample")
POSTPROC_WORK = ("detokenize",)
NOT_BUSY = ("idle",)


@dataclass
class SpanStats:
    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    total_ms: float


@dataclass
class ProcessSummary:
    role: str
    busy_pct: float
    spans: dict[str, SpanStats]
    counters: dict[str, tuple[float, float]] = field(default_factory=dict)  # mean, max


@dataclass
class Summary:
    window_ms: float
    processes: list[ProcessSummary]
    device_busy_pct: float
    device_idle_pct: float
    step_gap_mean_ms: float
    step_gap_p99_ms: float
    num_steps: int
    postproc_overlap_pct: float  # share of postprocessing time under a device span
    postproc_lag_steps_mean: float
    postproc_lag_steps_max: float
    num_plans: int = 0  # plans the gpu worker ran inside the window


# ---------------------------------------------------------------------- interval helpers


def _union(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: Sequence[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def _overlap(a: Sequence[tuple[int, int]], merged_b: Sequence[tuple[int, int]]) -> int:
    """Total length of `a` (any intervals) covered by `merged_b` (sorted, disjoint)."""
    starts = np.array([s for s, _ in merged_b], dtype=np.int64)
    total = 0
    for s, e in a:
        i = max(int(np.searchsorted(starts, s, side="right")) - 1, 0)
        while i < len(merged_b) and merged_b[i][0] < e:
            bs, be = merged_b[i]
            total += max(0, min(e, be) - max(s, bs))
            i += 1
    return total


def _window(profiles: Sequence[dict[str, Any]]) -> tuple[int, int]:
    starts = [p["started_ns"] for p in profiles if p.get("started_ns")]
    stops = [p["stopped_ns"] for p in profiles if p.get("stopped_ns")]
    spans = [s for p in profiles for s in p["spans"]]
    lo = min(starts) if starts else min((s[1] for s in spans), default=0)
    hi = max(stops) if stops else max((s[2] for s in spans), default=lo)
    return lo, max(hi, lo + 1)


def _stats(durations_ns: list[int]) -> SpanStats:
    ms = np.asarray(durations_ns, dtype=np.float64) / 1e6
    return SpanStats(len(ms), float(ms.mean()), float(np.percentile(ms, 50)),
                     float(np.percentile(ms, 99)), float(ms.sum()))


# ---------------------------------------------------------------------- summary


def summarize(profiles: Sequence[dict[str, Any]]) -> Summary:
    lo, hi = _window(profiles)
    window = hi - lo
    procs = []
    for p in profiles:
        by_name: dict[str, list[int]] = {}
        for name, s, e, _, _ in p["spans"]:
            by_name.setdefault(name, []).append(e - s)
        busy = _union([(s, e) for name, s, e, _, _ in p["spans"] if name not in NOT_BUSY])
        counters: dict[str, list[float]] = {}
        for name, _, value in p.get("counters", []):
            counters.setdefault(name, []).append(value)
        procs.append(ProcessSummary(
            p["role"], 100.0 * _length(busy) / window,
            {n: _stats(d) for n, d in sorted(by_name.items())},
            {n: (float(np.mean(v)), float(np.max(v))) for n, v in counters.items()}))
    worker_spans = [s for p in profiles if p["role"] == "gpu-worker" for s in p["spans"]]
    device = _union([(s, e) for name, s, e, _, _ in worker_spans if name in DEVICE_SPANS])
    steps = sorted((s, e) for name, s, e, _, _ in worker_spans if name == "forward")
    plans = {plan for _, _, _, plan, _ in worker_spans if plan >= 0}
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    post = [(s, e) for p in profiles if p["role"].startswith("postproc")
            for name, s, e, _, _ in p["spans"] if name in POSTPROC_WORK]
    post_total = _length(post)
    lags = [v for p in profiles if p["role"].startswith("postproc")
            for name, _, v in p.get("counters", []) if name == "lag_steps"]
    return Summary(
        window_ms=window / 1e6, processes=procs,
        device_busy_pct=100.0 * _length(device) / window,
        device_idle_pct=100.0 * (1 - _length(device) / window),
        step_gap_mean_ms=float(np.mean(gaps)) / 1e6 if gaps else 0.0,
        step_gap_p99_ms=float(np.percentile(gaps, 99)) / 1e6 if gaps else 0.0,
        num_steps=len(steps),
        postproc_overlap_pct=100.0 * _overlap(post, device) / post_total if post_total else 0.0,
        postproc_lag_steps_mean=float(np.mean(lags)) if lags else 0.0,
        postproc_lag_steps_max=float(np.max(lags)) if lags else 0.0,
        num_plans=len(plans))


def format_summary(s: Summary) -> str:
    lines = [f"window {s.window_ms:.1f} ms, {s.num_plans} plans, {s.num_steps} decode steps",
             f"device busy {s.device_busy_pct:.1f}%  idle {s.device_idle_pct:.1f}%  "
             f"gap between steps mean {s.step_gap_mean_ms:.3f} ms  p99 "
             f"{s.step_gap_p99_ms:.3f} ms",
             f"postprocessing under a device span: {s.postproc_overlap_pct:.1f}%  "
             f"postproc lag (steps) mean {s.postproc_lag_steps_mean:.2f} "
             f"max {s.postproc_lag_steps_max:.0f}", ""]
    head = f"  {'span':<26}{'count':>8}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}" \
           f"{'total ms':>11}"
    for p in s.processes:
        lines.append(f"{p.role:<28}busy {p.busy_pct:5.1f}%")
        lines.append(head)
        for name, st in p.spans.items():
            lines.append(f"  {name:<26}{st.count:>8}{st.mean_ms:>10.3f}{st.p50_ms:>10.3f}"
                         f"{st.p99_ms:>10.3f}{st.total_ms:>11.1f}")
        for name, (mean, mx) in p.counters.items():
            lines.append(f"  {name + ' (counter)':<26}mean {mean:.2f} max {mx:.0f}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- chrome trace


def _lane_order(role: str) -> tuple[int, str]:
    order = {"frontend": 0, "scheduler": 1, "gpu-worker": 2}
    return (order.get(role, 3), role)


def _span_args(plan: int, step: int) -> dict[str, int]:
    if plan < 0 and step >= 0:  # a frontend span: the last field is the request id
        return {"request": step}
    return {"plan": plan, "step": step}


def chrome_trace(profiles: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Chrome/Perfetto JSON: one lane (pid) per process, flow arrows from each step's
    forward in the gpu worker to the postprocessing of its tokens."""
    lo, _ = _window(profiles)
    events: list[dict[str, Any]] = []
    forward_at: dict[tuple[int, int], tuple[int, int]] = {}
    flow_id = 0
    ordered = sorted(profiles, key=lambda p: _lane_order(p["role"]))
    for pid, p in enumerate(ordered, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"tandem: {p['role']}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for name, s, e, plan, step in p["spans"]:
            ev = {"ph": "X", "name": name, "pid": pid, "tid": 0, "ts": (s - lo) / 1e3,
                  "dur": max(e - s, 1) / 1e3, "args": _span_args(plan, step)}
            events.append(ev)
            if p["role"] == "gpu-worker" and name == "forward":
                forward_at[(plan, step)] = (pid, e)
    for pid, p in enumerate(ordered, start=1):
        if not p["role"].startswith("postproc"):
            continue
        for name, s, _, plan, step in p["spans"]:
            src = forward_at.get((plan, step))
            if name not in POSTPROC_WORK or src is None:
                continue
            flow_id += 1
            events.append({"ph": "s", "id": flow_id, "name": "tokens", "cat": "flow",
                           "pid": src[0], "tid": 0, "ts": (src[1] - lo) / 1e3 - 0.001})
            events.append({"ph": "f", "bp": "e", "id": flow_id, "name": "tokens",
                           "cat": "flow", "pid": pid, "tid": 0, "ts": (s - lo) / 1e3})
    for pid, p in enumerate(ordered, start=1):
        for name, t, value in p.get("counters", []):
            events.append({"ph": "C", "name": name, "pid": pid, "tid": 0,
                           "ts": (t - lo) / 1e3, "args": {name: value}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ---------------------------------------------------------------------- picture


COLORS = {"forward": "#1f77b4", "sample": "#17becf", "prefill": "#9467bd",
          "publish": "#ff7f0e", "collect": "#8c564b", "apply": "#7f7f7f",
          "detokenize": "#2ca02c", "read": "#bcbd22", "send": "#d62728",
          "plan": "#e377c2", "tokenize": "#bcbd22", "stream_write": "#d62728",
          "validate": "#7f7f7f", "route": "#ff7f0e",
          "gc0": "#000000", "gc1": "#000000", "gc2": "#000000"}


def timeline_png(profiles: Sequence[dict[str, Any]], path: str, window_ms: float = 200.0,
                 title: str = "", centre: str = "forward") -> None:
    """One row per process over a short window around the gpu worker's median `centre`
    span (the middle of the recording when it has none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = _window(profiles)
    # Centre on the device's work, not on the recording: a workload may fill only part of it.
    forwards = sorted(s[1] for p in profiles if p["role"] == "gpu-worker"
                      for s in p["spans"] if s[0] == centre)
    mid = forwards[len(forwards) // 2] if forwards else lo + (hi - lo) // 2
    w0 = max(lo, mid - int(window_ms * 5e5))
    w1 = min(hi, w0 + int(window_ms * 1e6))
    ordered = sorted(profiles, key=lambda p: _lane_order(p["role"]))
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(ordered)))
    seen: set[str] = set()
    for row, p in enumerate(ordered):
        for name, s, e, _, _ in p["spans"]:
            if e < w0 or s > w1 or name in NOT_BUSY:
                continue
            label = name if name not in seen else None
            seen.add(name)
            ax.broken_barh([((s - w0) / 1e6, max(e - s, 1) / 1e6)], (row - 0.4, 0.8),
                           color=COLORS.get(name, "#aaaaaa"), label=label)
    ax.set_yticks(range(len(ordered)))
    ax.set_yticklabels([p["role"] for p in ordered])
    ax.invert_yaxis()
    ax.set_xlim(0, (w1 - w0) / 1e6)
    ax.set_xlabel("ms")
    ax.set_title(title or "Tandem timeline")
    ax.legend(loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
