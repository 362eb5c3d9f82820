"""The stall figures of one scenario run, and the tables comparing the arms of a run.

On a shared, noisy machine absolute times drift between rounds, so the comparison is the
median over rounds of ratios taken within a round (the arms of a round ran back to back).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

import numpy as np

from tandem_serve.bench.stall.scenario import GapRatios, Stamps


@dataclass
class Figures(GapRatios):
    median_gap_ms: float
    p99_gap_ms: float
    worst_gap_ms: float
    ttft_ms: float  # the long prompts' median time to first token
    worst_ttft_ms: float
    tokens_per_s: float  # every token the window saw, streams and prompts
    num_gaps: int



def figures(stamps: Stamps) -> Figures:
    lo, hi = stamps.window
    gaps: list[float] = []
    tokens = 0
    for times in stamps.streams:
        t = np.asarray(times)
        inside = (t[1:] >= lo) & (t[1:] <= hi)
        gaps += (np.diff(t)[inside] * 1e3).tolist()
        tokens += int(((t >= lo) & (t <= hi)).sum())
    for times in stamps.prompt_tokens:
        t = np.asarray(times)
        tokens += int(((t >= lo) & (t <= hi)).sum())
    ttft = [(f - s) * 1e3 for s, f in zip(stamps.sent, stamps.first, strict=True)]
    g = np.asarray(gaps)
    return Figures(median_gap_ms=float(np.median(g)), p99_gap_ms=float(np.percentile(g, 99)),
                   worst_gap_ms=float(g.max()), ttft_ms=float(np.median(ttft)),
                   worst_ttft_ms=float(max(ttft)), tokens_per_s=tokens / (hi - lo),
                   num_gaps=len(gaps))


def arm_table(results: dict[str, list[Figures]]) -> str:
    lines = ["| arm | round | median gap ms | p99 gap ms | worst gap ms | worst / median | "
             "p99 / median | long-prompt TTFT ms (median, worst) | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, rounds in results.items():
        for i, f in enumerate(rounds):
            lines.append(f"| {arm} | {i + 1} | {f.median_gap_ms:.1f} | {f.p99_gap_ms:.1f} | "
                         f"{f.worst_gap_ms:.1f} | {f.worst_ratio:.1f}x | {f.p99_ratio:.1f}x | "
                         f"{f.ttft_ms:.0f}, {f.worst_ttft_ms:.0f} | {f.tokens_per_s:.0f} |")
    return "\n".join(lines)


def ratio_table(results: dict[str, list[Figures]], arm: str, baseline: str) -> str:
    """Within-round ratios of `arm` to `baseline`, and their medians."""
    pairs = list(zip(results[arm], results[baseline], strict=True))
    rows = {
        f"{arm} worst gap / median gap": [a.worst_ratio for a, _ in pairs],
        f"{baseline} worst gap / median gap": [b.worst_ratio for _, b in pairs],
        f"{arm} p99 gap / median gap": [a.p99_ratio for a, _ in pairs],
        f"{baseline} p99 gap / median gap": [b.p99_ratio for _, b in pairs],
        f"long-prompt TTFT, {arm} / {baseline}": [a.ttft_ms / b.ttft_ms for a, b in pairs],
        f"tokens/s, {arm} / {baseline}": [a.tokens_per_s / b.tokens_per_s for a, b in pairs],
        f"median gap, {arm} / {baseline}": [a.median_gap_ms / b.median_gap_ms
                                            for a, b in pairs],
    }
    lines = ["| ratio | per round | median |", "|---|---|---|"]
    for name, values in rows.items():
        per = ", ".join(f"{v:.2f}" for v in values)
        lines.append(f"| {name} | {per} | {median(values):.2f} |")
    return "\n".join(lines)


def frontier(results: dict[str, list[Figures]], arms: list[str], baseline: str
             ) -> list[dict[str, float | str]]:
    """Per mixed arm (a budget each): its worst gap over the median against its long-prompt
    TTFT over `baseline`'s, medians of within-round ratios, beside the TTFT ratio such a worst
    gap allows at best.  A step costing g decode steps carries (g - 1) decode steps' worth of
    prefill, so a prompt of W prefill-seconds takes W / (g - 1) decode steps more than one
    forward of its own would: TTFT >= (1 + 1 / (g - 1)) W, queueing aside (both arms wait for a
    plan to start)."""
    rows: list[dict[str, float | str]] = []
    for arm in arms:
        pairs = list(zip(results[arm], results[baseline], strict=True))
        worst = median(a.worst_ratio for a, _ in pairs)
        rows.append({
            "arm": arm, "worst_ratio": worst, "p99_ratio": median(a.p99_ratio for a, _ in pairs),
            "ttft_ratio": median(a.ttft_ms / b.ttft_ms for a, b in pairs),
            "ttft_bound": 1 + 1 / (worst - 1) if worst > 1 else float("inf"),
            "tokens_per_s_ratio": median(a.tokens_per_s / b.tokens_per_s for a, b in pairs)})
    return rows


def frontier_table(results: dict[str, list[Figures]], arms: list[str], baseline: str) -> str:
    lines = ["| arm | worst gap / median | p99 gap / median | long-prompt TTFT vs "
             f"{baseline} | TTFT bound at that worst gap | tokens/s vs {baseline} |",
             "|---|---|---|---|---|---|"]
    for r in frontier(results, arms, baseline):
        lines.append(f"| {r['arm']} | {r['worst_ratio']:.2f}x | {r['p99_ratio']:.2f}x | "
                     f"{r['ttft_ratio']:.2f}x | {r['ttft_bound']:.2f}x | "
                     f"{r['tokens_per_s_ratio']:.2f}x |")
    return "\n".join(lines)


def client_table(served: dict[str, list[Figures]], inproc: dict[str, list[Figures]] | None,
                 sides: dict[str, list[Any]] | None) -> str:
    """Per arm and round, the gRPC client's worst and p99 gaps (multiples of its median) beside
    the in-process ones (`inproc`, the same round's seed) and the server's record of the round
    (`sides`: hops.ServerSide, the gpu worker's own gaps on the wall clock, the longest
    collector pause, the worker's waits for its core and the other processes' CPU, as % of
    the round and of one core); then, per arm, the medians over rounds."""
    head = ["arm", "round", "client worst / median", "client p99 / median"]
    if inproc is not None:
        head += ["in-process worst / median", "in-process p99 / median",
                 "client worst / in-process worst"]
    if sides:
        head += ["worker worst / median (wall)", "worker p99 / median (wall)",
                 "longest gc pause ms (process)", "worker waiting for its core",
                 "other processes' CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, rounds in served.items():
        columns: list[list[float]] = []
        for i, f in enumerate(rounds):
            values = [f.worst_ratio, f.p99_ratio]
            cells = [f"{f.worst_ratio:.1f}x", f"{f.p99_ratio:.1f}x"]
            if inproc is not None:
                g = inproc[arm][i]
                values += [g.worst_ratio, g.p99_ratio, f.worst_ratio / g.worst_ratio]
                cells += [f"{g.worst_ratio:.1f}x", f"{g.p99_ratio:.1f}x",
                          f"{f.worst_ratio / g.worst_ratio:.2f}"]
            if sides:
                side = sides[arm][i]
                role, pause = max(side.gc_ms.items(), key=lambda kv: kv[1], default=("-", 0.0))
                values += [side.worst_ratio, side.p99_ratio]
                cells += [f"{side.worst_ratio:.1f}x", f"{side.p99_ratio:.1f}x",
                          f"{pause:.1f} ({role})", _pct(side.worker_wait_pct),
                          _pct(side.others_cpu_pct)]
            columns.append(values)
            lines.append(f"| {arm} | {i + 1} | " + " | ".join(cells) + " |")
        if len(rounds) > 1:
            meds = [median(c[j] for c in columns) for j in range(len(columns[0]))]
            cells = [f"{v:.2f}" if head[2 + j].startswith("client worst / in") else f"{v:.1f}x"
                     for j, v in enumerate(meds)]
            lines.append(f"| {arm} | median | " + " | ".join(cells) +
                         (" | | | |" if sides else " |"))
    return "\n".join(lines)


def _pct(value: float) -> str:
    return f"{value:.0f}%" if value >= 0 else "-"


def from_json(data: dict[str, Any]) -> dict[str, list[Figures]]:
    """`as_json`'s arms back as Figures."""
    return {arm: [Figures(**f) for f in rounds] for arm, rounds in data["arms"].items()}


def as_json(results: dict[str, list[Figures]], settings: dict[str, Any]) -> dict[str, Any]:
    return {"settings": settings,
            "arms": {arm: [asdict(f) for f in rounds] for arm, rounds in results.items()}}
