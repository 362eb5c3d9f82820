"""`tandem bench lora --step`: decode ms/step with adapters next to the base, in one process.

Serving figures on a shared CPU host scatter more than LoRA costs; this isolates the device
side.  One `ModelRunner` (one torch thread, like the pinned gpu worker on 2 cores) runs a
batch of fresh requests per arm, prefill then K-step plans through `execute`, arms
alternating: the base model, every row on one adapter, rows spread over every adapter, and
half the rows on no adapter.  Median and fastest ms/step per arm, with ratios to the base.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem_serve.harness.arms import rounds


def step_table(model: str, cache: str, ids: list[str], rank: int, batch: int = 32,
               prompt_len: int = 128, steps: int = 32, k: int = 8, repeats: int = 5) -> str:
    import torch

    from tandem_serve.gpu_worker.publisher import TokenPublisher
    from tandem_serve.gpu_worker.runner import ModelRunner
    from tandem_serve.proto.adapter_messages import AdapterLoad
    from tandem_serve.proto.config import WorkerConfig
    from tandem_serve.proto.plan_messages import NewRequest, StepPlan
    from tandem_serve.proto.request_params import SamplingParams

    torch.set_num_threads(1)
    per_req = -(-(prompt_len + steps + 1) // 16)
    runner = ModelRunner(WorkerConfig(model, device="cpu", dtype="float32", block_size=16,
                                      num_kv_blocks=batch * per_req, max_num_seqs=batch,
                                      adapter_cache=cache, max_loras=len(ids), max_lora_rank=rank))
    publisher = TokenPublisher(lambda msg: None, runner.device)
    plan_ids = iter(range(1 << 62))
    live: list[int] = []

    def execute(num_steps: int, **deltas: Any) -> None:
        runner.execute(StepPlan(next(plan_ids), num_steps, **deltas), publisher)

    execute(1, adapters=[AdapterLoad(i + 1, a) for i, a in enumerate(ids)])
    rng = np.random.default_rng(0)

    def samples(slot_of: Callable[[int], int]) -> list[float]:
        nonlocal live
        first = max(live, default=-1) + 1
        new = [NewRequest(first + i, rng.integers(3, runner.vocab_size, prompt_len,
                                                  dtype=np.int32),
                          SamplingParams(max_new_tokens=1 << 30),
                          list(range(i * per_req, (i + 1) * per_req)), 0, prompt_len - 1,
                          lora_slot=slot_of(i)) for i in range(batch)]
        execute(1, new=new, drop=live)
        live = [n.request_id for n in new]
        out = []
        for _ in range(steps // k):
            t0 = time.perf_counter()
            execute(k)
            out.append((time.perf_counter() - t0) / k * 1e3)
        return out

    n = len(ids)
    arms: dict[str, Callable[[int], int]] = {
        "base model": lambda i: 0, "1 adapter": lambda i: 1,
        f"{n} adapters": lambda i: 1 + i % n, f"half base, {n} adapters": lambda i: (
            0 if i % 2 else 1 + (i // 2) % n)}
    got: dict[str, list[float]] = {a: [] for a in arms}
    for rep, order in rounds(list(arms.items()), repeats):
        for name, slot_of in order:
            got[name] += samples(slot_of)
        print(f"[bench lora --step] {rep + 1}/{repeats}", file=sys.stderr, flush=True)
    publisher.close()
    base_med = statistics.median(got["base model"])
    base_min = min(got["base model"])
    lines = [f"| batch {batch}, K={k} | ms/step median | fastest | median vs base | "
             "fastest vs base |", "|---|---:|---:|---:|---:|"]
    for name, ms in got.items():
        med, low = statistics.median(ms), min(ms)
        lines.append(f"| {name} | {med:.2f} | {low:.2f} | {med / base_med:.2f}× | "
                     f"{low / base_min:.2f}× |")
    return "\n".join(lines)
