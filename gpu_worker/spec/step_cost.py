"""The wall time of one decode forward over n rows, as speculation's step costs need it
(`gpu_worker.spec.policy` times the target, `gpu_worker.spec.draft_model` the draft model)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

# (ids, positions, active, block tables, context bound, row_lens=...) -> logits
DecodeForward = Callable[..., torch.Tensor]


def decode_timer(forward: DecodeForward, device: torch.device, max_model_len: int,
                 block_size: int) -> Callable[[int], float]:
    """A `StepCost` measure: the wall time of a decode forward over n masked rows (they
    write nothing) at a context of up to 256 positions, device work included."""
    ctx = min(max_model_len, 256)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @torch.inference_mode()
    def measure(rows: int) -> float:
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        positions = torch.full((rows,), ctx - 1, dtype=torch.int64, device=device)
        active = torch.zeros(rows, dtype=torch.bool, device=device)
        tables = torch.zeros((rows, -(-ctx // block_size)), dtype=torch.int32, device=device)
        sync()
        t0 = time.perf_counter()
        forward(ids, positions, active, tables, ctx, row_lens=[ctx] * rows)
        sync()
        return time.perf_counter() - t0
    return measure
