"""`tandem bench ab`'s output: the arm table with ratios to sync K=1, CPU seconds per
process, HTTP / gRPC and peer throughput ratios, the PNG chart."""
from __future__ import annotations

from typing import Any

from tandem_serve.harness.tables import cell

PEER_NAMES = {"transformers-serve": "transformers serve", "hf-generate": "hf generate()"}
COLUMNS = [("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("mean_itl_ms", "ITL ms"),
           ("output_throughput", "out tok/s"), ("device_idle_pct", "device idle %"),
           ("steady_idle_pct", "idle % in steady decode"),
           ("forward_ms_per_plan", "forward ms/plan"),
           ("postproc_ms_per_plan", "postproc ms/plan")]


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per arm, with ratios to sync K=1 (or, without it, to the first sync arm)."""
    syncs = [n for n in results if n.startswith("sync K=")]
    base_name = "sync K=1" if "sync K=1" in results else syncs[0] if syncs else ""
    base = results.get(base_name)
    head = "| arm | " + " | ".join(c for _, c in COLUMNS) + \
        f" | TPOT vs {base_name or 'sync'} | throughput vs {base_name or 'sync'} |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for name, r in results.items():
        cells = [cell(r, k) for k, _ in COLUMNS]
        if base:
            cells += [f"{r['mean_tpot_ms'] / base['mean_tpot_ms']:.2f}×",
                      f"{r['output_throughput'] / base['output_throughput']:.2f}×"]
        else:
            cells += ["–", "–"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(results: dict[str, dict[str, Any]]) -> str:
    """CPU seconds per process over each run: where a CPU host's cores went."""
    roles: list[str] = []
    for r in results.values():
        roles += [k for k in r.get("cpu_s", {}) if k not in roles]
    lines = ["| arm | wall s | " + " | ".join(roles) + " |", "|" + "---|" * (len(roles) + 2)]
    for name, r in results.items():
        cpu = r.get("cpu_s", {})
        cells = [f"{cpu[k]:.2f}" if k in cpu else "–" for k in roles]
        lines.append(f"| {name} | {r.get('duration', 0.0):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _k(name: str) -> int:
    return int(name.split("=")[1].split()[0])


def peer_ratios(results: dict[str, dict[str, Any]]) -> str:
    """Output throughput of Tandem's async arm with the largest K over each peer's, measured
    in the same run: over HTTP against transformers serve when that arm ran (the same
    client on both sides), else over gRPC."""
    grpc_arms = [n for n in results if n.startswith("async K=") and not n.endswith("HTTP")]
    http_arms = [n for n in results if n.startswith("async K=") and n.endswith("HTTP")]
    parts = []
    for name, r in results.items():
        if name not in PEER_NAMES.values() or not r.get("output_throughput"):
            continue
        ours = http_arms if name == PEER_NAMES["transformers-serve"] and http_arms \
            else grpc_arms
        if ours:
            arm = max(ours, key=_k)
            mine = results[arm]["output_throughput"]
            parts.append(f"{arm} output throughput = {mine / r['output_throughput']:.2f}× "
                         f"{name}'s")
    return "; ".join(parts)


def http_ratios(results: dict[str, dict[str, Any]]) -> str:
    """Each HTTP arm's output throughput and mean TPOT over its gRPC twin's."""
    parts = []
    for name, r in results.items():
        twin = results.get(name.removesuffix(" HTTP")) if name.endswith(" HTTP") else None
        if twin and twin.get("output_throughput") and r.get("output_throughput"):
            parts.append(f"{name}: output throughput = "
                         f"{r['output_throughput'] / twin['output_throughput']:.3f}× gRPC's, "
                         f"mean TPOT = {r['mean_tpot_ms'] / twin['mean_tpot_ms']:.3f}× gRPC's")
    return "; ".join(parts)


PREFILL_RATIOS = [("p99_itl_ms", "ITL p99"), ("median_itl_ms", "ITL p50"),
                  ("p99_tpot_ms", "TPOT p99"), ("median_tpot_ms", "TPOT p50"),
                  ("mean_ttft_ms", "TTFT"), ("output_throughput", "output throughput")]


def prefill_ratios(results: dict[str, dict[str, Any]]) -> str:
    """Each arm's figures over its --prefill-phase twin's: mixed steps against a separate
    prefill forward, both measured in this run."""
    lines = []
    for name, twin in results.items():
        if not name.endswith(" prefill-phase") or name.removesuffix(" prefill-phase") \
                not in results:
            continue
        mine = results[name.removesuffix(" prefill-phase")]
        parts = [f"{label} {mine[k] / twin[k]:.2f}×" for k, label in PREFILL_RATIOS
                 if mine.get(k) and twin.get(k)]
        lines.append(f"{name.removesuffix(' prefill-phase')} (mixed steps) / {name}: "
                     + ", ".join(parts))
    return "\n".join(lines)


def chart(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(4.4 * 3, 3.8))
    for ax, (key, label) in zip(axes, [("mean_tpot_ms", "mean TPOT (ms)"),
                                       ("output_throughput", "output tok/s"),
                                       ("steady_idle_pct", "device idle in steady decode (%)")],
                                 strict=True):
        raw = [results[n].get(key) for n in names]
        values = [v or 0.0 for v in raw]
        colors = ["#9ecae1" if "unpaced" in n else "#1f77b4" if "async" in n
                  else "#ff7f0e" if "sync" in n else "#7f7f7f" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=25)
        for i, v in enumerate(raw):  # a peer has no engine counters: say so, not 0
            ax.text(i, v or 0.0, "n/a" if v is None else f"{v:.1f}", ha="center",
                    va="bottom", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
