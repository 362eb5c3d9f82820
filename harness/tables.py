"""Markdown tables of arms: one row per arm, figures as medians over repeats."""
from __future__ import annotations

from typing import Any

from tandem_serve.harness.stats import median_result, paired_ratio


def cell(r: dict[str, Any], key: str) -> str:
    """One figure with two decimals, or a dash when the arm has none."""
    v = r.get(key)
    return "–" if v is None else f"{v:.2f}"


def paired_table(runs: dict[str, list[dict[str, Any]]], base: str,
                 columns: list[tuple[str, str]]) -> str:
    """Arms of one server (`bench lora`, `bench guided`): per-figure medians, then TPOT and
    throughput as paired ratios to `base`."""
    results = {name: median_result(rs) for name, rs in runs.items()}
    head = "| arm | " + " | ".join(c for _, c in columns) + \
        f" | TPOT vs {base} | throughput vs {base} |"
    lines = [head, "|" + "---|" * (len(columns) + 3)]
    for name, r in results.items():
        cells = [cell(r, k) for k, _ in columns]
        cells += [f"{paired_ratio(runs, name, base, 'mean_tpot_ms'):.2f}×",
                  f"{paired_ratio(runs, name, base, 'output_throughput'):.2f}×"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
