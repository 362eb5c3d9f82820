"""Figures over repeated runs: nearest-rank percentiles, per-figure medians, paired ratios."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`th percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of repeated runs (numbers only; CPU seconds per process too)."""
    out = dict(runs[-1])
    for key, value in runs[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(float(r[key]) for r in runs if key in r)
    roles = {role for r in runs for role in r.get("cpu_s", {})}
    out["cpu_s"] = {role: statistics.median(r.get("cpu_s", {}).get(role, 0.0) for r in runs)
                    for role in sorted(roles)}
    out["repeats"] = len(runs)
    return out


def paired_ratio(runs: dict[str, list[dict[str, Any]]], name: str, base: str, key: str) -> float:
    """Median over repeats of arm / base within the same repeat: the arms of one repeat run
    back to back on one server, so a slow drift of a shared machine cancels out."""
    pairs = zip(runs[name], runs[base], strict=True)
    return statistics.median(r[key] / b[key] for r, b in pairs)
