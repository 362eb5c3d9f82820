"""`tandem bench step --tensor-parallel-size N`: ms/step of one rank next to N ranks (this
process and N-1 gpu worker processes, gloo) on the same cores, alternating."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem_serve.bench.step.runner import Ours, progress, random_prompts
from tandem_serve.harness.arms import rounds


@dataclass
class TPRow:
    batch: int
    tp1_ms: float  # median ms/step, one rank
    tp_ms: float  # median ms/step, `tp` ranks
    tp: int

    @property
    def ratio(self) -> float:
        return self.tp_ms / self.tp1_ms


def measure_tp(model: str, batches: list[int], prompt_len: int, steps: int, k: int,
               repeats: int, tp: int, threads: int) -> list[TPRow]:
    """ms/step with one rank (`threads` torch threads) next to `tp` ranks sharing the same
    cores (threads / tp each), the two alternating run by run."""
    per_rank = max(1, threads // tp)
    one = Ours(model, max(batches), prompt_len + steps + k, k, threads=threads)
    group = Ours(model, max(batches), prompt_len + steps + k, k, tp=tp, threads=per_rank)
    rows = []
    try:
        for b in batches:
            prompts = random_prompts(b, prompt_len, one.runner.vocab_size)
            one.samples(prompts, k)  # warm-up
            group.samples(prompts, k)
            samples: dict[int, list[float]] = {1: [], tp: []}
            for r, order in rounds([one, group], repeats):
                for arm in order:
                    samples[1 if arm is one else tp] += arm.samples(prompts, steps)
                progress(f"batch {b}: run {r + 1}/{repeats}")
            row = TPRow(b, float(np.median(samples[1])), float(np.median(samples[tp])), tp)
            rows.append(row)
            progress(f"batch {b}: TP=1 {row.tp1_ms:.2f} ms/step, TP={tp} {row.tp_ms:.2f}, "
                     f"ratio {row.ratio:.2f}")
    finally:
        one.close()
        group.close()
    return rows


def format_tp_table(rows: list[TPRow], threads: int) -> str:
    tp = rows[0].tp if rows else 2
    lines = [f"| batch | TP=1 ms/step ({threads} threads) | TP={tp} ms/step "
             f"({max(1, threads // tp)} thread(s) per rank) | TP={tp} / TP=1 |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.tp1_ms:.2f} | {r.tp_ms:.2f} | {r.ratio:.2f} |")
    return "\n".join(lines)
