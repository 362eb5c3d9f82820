"""The memory-bandwidth bound of a decode step, honestly: the bytes the step must read over
the rate the device reads at.

* The rate comes from a read-only probe: one pass of a reduction over a tensor far larger
  than any cache (2 GiB on CUDA), timed with CUDA events, bytes read / seconds, the fastest
  of a few passes.  A copy would be the wrong yardstick: it moves each byte twice (read and
  write) through the same memory, so its bytes-moved rate already *is* what a read-only
  stream reaches, and halving it to get a "read" rate makes every bound twice as long and
  a step at twice the bound read as at it.
* A decode step reads every weight once (the layers and the LM head; the embedding is a
  gather of B rows) and the K and V of every token each row attends to.
"""
from __future__ import annotations

import time
from collections.abc import Callable

READ_BYTES_CUDA = 2 << 30
READ_BYTES_CPU = 256 << 20
READ_PASSES = 5


def read_bandwidth_gbs(device: str, nbytes: int = 0, passes: int = READ_PASSES) -> float:
    """Bytes per second (GB/s, 1e9) one reduction over `nbytes` reads on `device`."""
    import torch

    n = nbytes or (READ_BYTES_CUDA if device == "cuda" else READ_BYTES_CPU)
    held = [torch.ones(n // 4, dtype=torch.float32, device=device)]
    try:
        seconds = fastest(lambda: held[0].sum(), device, passes)
    finally:
        held.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    return n / seconds / 1e9


def fastest(fn: Callable[[], object], device: str, passes: int) -> float:
    """Seconds of the fastest of `passes` runs of `fn` (after one warm-up): CUDA events on
    the device's stream, the wall clock on the CPU."""
    import torch

    fn()
    best = float("inf")
    for _ in range(passes):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def step_read_bytes(weight_bytes: int, kv_bytes_per_token: int, batch: int,
                    context: float) -> float:
    """Bytes one decode step must read: the weights once, and each of `batch` rows' K and V
    over its `context` tokens."""
    return weight_bytes + batch * context * kv_bytes_per_token


def ideal_step_ms(read_bytes: float, read_gbs: float) -> float:
    """The step's time at the device's read bandwidth: bytes it must read / bytes per ms."""
    return read_bytes / (read_gbs * 1e9) * 1e3
