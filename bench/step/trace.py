"""`tandem bench step --trace`: what span recording costs a decode step, tracer off and on
in alternating runs, and one span timed alone."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem_serve.bench.step.runner import Ours, progress, random_prompts
from tandem_serve.harness.arms import rounds


@dataclass
class TraceRow:
    batch: int
    off_ms: float  # median ms/step, tracer off
    on_ms: float  # median ms/step, tracer on
    spans_per_step: float
    span_off_ns: float  # one span, tracer off
    span_on_ns: float

    @property
    def ratio(self) -> float:
        return self.on_ms / self.off_ms

    @property
    def off_pct(self) -> float:
        return 100 * self.spans_per_step * self.span_off_ns / (self.off_ms * 1e6)

    @property
    def on_pct(self) -> float:
        return 100 * self.spans_per_step * self.span_on_ns / (self.off_ms * 1e6)


def span_cost_ns(enabled: bool, n: int = 200_000) -> float:
    """Nanoseconds one `with tracer.span(...)` costs, the bare loop taken off."""
    from tandem_serve.ipc.tracing import Tracer

    tracer = Tracer("bench")
    if enabled:
        tracer.start()
    best = float("inf")
    for _ in range(5):  # the quietest of a few rounds: a neighbour's time slice is not ours
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pass
        t1 = time.perf_counter_ns()
        for _ in range(n):
            with tracer.span("forward", 1, 2):
                pass
        t2 = time.perf_counter_ns()
        best = min(best, ((t2 - t1) - (t1 - t0)) / n)
        tracer.spans.clear()
    return best


def spans_per_step(spans: list[list[Any]]) -> float:
    """Spans of the decode plans per decode step, plus the worker loop's one per plan."""
    by_plan: dict[int, list[str]] = {}
    for s in spans:
        by_plan.setdefault(s[3], []).append(s[0])
    decode = [names for names in by_plan.values() if "prefill" not in names]
    steps = sum(names.count("forward") for names in decode)
    return (sum(len(names) + 1 for names in decode)) / max(steps, 1)  # +1: "idle"


def measure_trace(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
                  repeats: int) -> list[TraceRow]:
    from tandem_serve.ipc.tracing import TRACER

    ours = Ours(model, max(batches), prompt_len + steps + k, k)
    costs = span_cost_ns(False), span_cost_ns(True)
    rows = []
    try:
        for b in batches:
            prompts = random_prompts(b, prompt_len, ours.runner.vocab_size)
            ours.samples(prompts, k)  # warm-up
            samples: dict[bool, list[float]] = {False: [], True: []}
            per_step: list[float] = []
            for r, order in rounds([False, True], repeats):
                for traced in order:
                    if traced:
                        TRACER.start()
                    samples[traced] += ours.samples(prompts, steps)
                    if traced:
                        per_step.append(spans_per_step(TRACER.stop()["spans"]))
                progress(f"batch {b}: run {r + 1}/{repeats}")
            row = TraceRow(b, float(np.median(samples[False])), float(np.median(samples[True])),
                           float(np.mean(per_step)), *costs)
            rows.append(row)
            progress(f"batch {b}: off {row.off_ms:.2f} ms/step, on {row.on_ms:.2f}, "
                     f"span cost off {row.off_pct:.4f}%, on {row.on_pct:.3f}% of a step")
    finally:
        ours.close()
    return rows


def format_trace_table(rows: list[TraceRow]) -> str:
    lines = ["| batch | ms/step off | ms/step on | on / off | spans/step | span ns off | "
             "span ns on | off % of step | on % of step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.off_ms:.2f} | {r.on_ms:.2f} | {r.ratio:.3f} | "
                     f"{r.spans_per_step:.2f} | {r.span_off_ns:.0f} | {r.span_on_ns:.0f} | "
                     f"{r.off_pct:.4f} | {r.on_pct:.3f} |")
    return "\n".join(lines)
