"""`tandem bench step`'s default figure: decode ms/step of ours next to HF `generate()` on
the same checkpoint and batch, median samples over alternating runs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem_serve.bench.step.runner import HF, Ours, Placement, progress, random_prompts


@dataclass
class Row:
    batch: int
    ours_ms: float  # median sample
    hf_ms: float | None
    ours_min_ms: float = 0.0  # fastest sample: what a quiet machine gives
    hf_min_ms: float | None = None
    weight_bytes: int = 0  # what ours holds on the device (quantized linears as stored)

    @property
    def ratio(self) -> float | None:
        return None if self.hf_ms is None else self.ours_ms / self.hf_ms


def measure(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
            repeats: int, with_hf: bool, where: Placement = Placement()) -> list[Row]:
    from tandem_serve.gpu_worker.models.loader import weight_bytes

    ours = Ours(model, max(batches), prompt_len + steps + k, k, where=where)
    held = weight_bytes(ours.runner.model)
    progress(f"weights: {held / 2**30:.3f} GiB")
    hf = HF(model, where) if with_hf else None
    vocab = ours.runner.vocab_size
    rows = []
    try:
        for b in batches:
            prompts = random_prompts(b, prompt_len, vocab)
            ours.samples(prompts, k)  # warm-up (allocator, oneDNN primitives)
            if hf is not None:
                hf.samples(prompts, 2, 1)
            mine: list[float] = []
            theirs: list[float] = []
            for r in range(repeats):
                mine += ours.samples(prompts, steps)
                if hf is not None:
                    theirs += hf.samples(prompts, steps, k)
                progress(f"batch {b}: run {r + 1}/{repeats}")
            row = Row(b, float(np.median(mine)), float(np.median(theirs)) if theirs else None,
                      min(mine), min(theirs) if theirs else None, held)
            rows.append(row)
            progress(f"batch {b}: ours {row.ours_ms:.2f} ms/step" + (
                "" if row.hf_ms is None or row.ratio is None
                else f", HF {row.hf_ms:.2f} ms/step, ratio {row.ratio:.2f}"))
    finally:
        ours.close()
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| batch | ours ms/step | HF ms/step | ours / HF | weights MiB |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        hf = "-" if r.hf_ms is None else f"{r.hf_ms:.2f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        held = f"{r.weight_bytes / 2**20:.1f}" if r.weight_bytes else "-"
        lines.append(f"| {r.batch} | {r.ours_ms:.2f} | {hf} | {ratio} | {held} |")
    return "\n".join(lines)
