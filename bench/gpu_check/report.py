"""The report `scripts/gpu-check` writes: results.json and report.md, rewritten after every
stage, so a run cut short (the GPU window closed, the host died) still leaves what it did.
Also the time budget that decides which stages still fit, and the progress lines."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# The seed's figures (vLLM, Llama-3.1-8B, one H100, 200 prompts at 10 req/s, 1,024-token
# prompts with a 512-token shared prefix, 512 output tokens): multi-step 8 without, then with
# the asynchronous output processor.
SEED_FIGURES = {
    "sync K=8": {"mean_tpot_ms": 27.71, "output_throughput": 3340.97, "mean_ttft_ms": 155.89},
    "async K=8": {"mean_tpot_ms": 21.05, "output_throughput": 3732.37, "mean_ttft_ms": 120.86},
}


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


@dataclass
class Budget:
    """Seconds left for the whole run; a stage that needs more than is left is skipped."""

    total_s: float
    started: float = field(default_factory=time.monotonic)

    @property
    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.started)

    def allows(self, need_s: float) -> bool:
        return self.left >= need_s


@dataclass
class Stage:
    name: str
    status: str  # "passed" | "failed" | "skipped" | "done"
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    markdown: str = ""
    error: str = ""


class Report:
    def __init__(self, out: str, title: str, settings: dict[str, Any]) -> None:
        self.out = out
        self.title = title
        self.settings = settings
        self.stages: list[Stage] = []
        os.makedirs(out, exist_ok=True)
        self.write()

    def add(self, stage: Stage) -> None:
        self.stages.append(stage)
        self.write()

    def write(self) -> None:
        data = {"title": self.title, "settings": self.settings,
                "stages": {s.name: {"status": s.status, "seconds": round(s.seconds, 1),
                                    "figures": s.figures, "error": s.error}
                           for s in self.stages}}
        _atomic(os.path.join(self.out, "results.json"), json.dumps(data, indent=2, default=str))
        _atomic(os.path.join(self.out, "report.md"), self.markdown())

    def markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        lines += [f"- {k}: {v}" for k, v in self.settings.items()]
        lines += ["", "| stage | status | seconds |", "|---|---|---:|"]
        lines += [f"| {s.name} | {s.status}{': ' + _one_line(s.error) if s.error else ''} | "
                  f"{s.seconds:.0f} |" for s in self.stages]
        for s in self.stages:
            if s.markdown:
                lines += ["", f"## {s.name}", "", s.markdown.rstrip()]
        return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")


def _atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _fmt(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "–"


def experiment_table(arms: dict[str, dict[str, Any]], with_seed: bool) -> str:
    """The seed's table: our arms next to vLLM's H100 figures, ratios to sync K=1."""
    head = ["arm", "TTFT ms", "TPOT ms", "out tok/s", "idle % (steady decode)",
            "forward ms/plan", "postproc ms/plan", "TPOT vs sync K=1"]
    if with_seed:
        head += ["seed TPOT ms (H100)", "seed out tok/s (H100)"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    base = arms.get("sync K=1", {}).get("mean_tpot_ms")
    for name, r in arms.items():
        ratio = r["mean_tpot_ms"] / base if base and "mean_tpot_ms" in r else None
        cells = [name, _fmt(r.get("mean_ttft_ms")), _fmt(r.get("mean_tpot_ms")),
                 _fmt(r.get("output_throughput"), 1), _fmt(r.get("steady_idle_pct")),
                 _fmt(r.get("forward_ms_per_plan")), _fmt(r.get("postproc_ms_per_plan")),
                 f"{ratio:.2f}×" if ratio else "–"]
        if with_seed:
            seed = SEED_FIGURES.get(name, {})
            cells += [_fmt(seed.get("mean_tpot_ms")), _fmt(seed.get("output_throughput"), 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def step_table(rows: list[dict[str, Any]]) -> str:
    """`bench step`'s rows with each row's bandwidth bound (`bound_ms`, bound.py)."""
    lines = ["| batch | ours ms/step | HF generate() ms/step | ours / HF | bandwidth bound ms |"
             " ours / bound |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ours, bound = r.get("ours_ms"), r.get("bound_ms")
        over = ours / bound if bound and ours else None
        lines.append(f"| {r['batch']} | {_fmt(ours)} | {_fmt(r.get('hf_ms'))} | "
                     f"{_fmt(r.get('ratio'))} | {_fmt(bound, 3)} | {_fmt(over)} |")
    return "\n".join(lines)
