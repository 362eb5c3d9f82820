"""The soak's load: Poisson arrivals of the request mix through gRPC streams from a pool."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem_serve.bench.soak.mix import DEFAULT_MIX, RequestStats, parse_mix, run_one

DEFAULT = parse_mix(DEFAULT_MIX, 0.0)


def drive(client: Any, rate: float, seconds: float, max_new_tokens: int, concurrency: int,
          stats: RequestStats, stop: threading.Event, seed: int = 0,
          mix: dict[str, float] | None = None) -> int:
    """Poisson arrivals at `rate` per second for `seconds`; returns how many were sent."""
    rng = random.Random(seed)
    sent = 0
    t0 = time.monotonic()
    next_at = t0
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="soak")
    try:
        while not stop.is_set():
            next_at += rng.expovariate(rate)
            if next_at - t0 > seconds:
                break
            delay = next_at - time.monotonic()
            if delay > 0 and stop.wait(delay):
                break
            pool.submit(run_one, client, seed * 1_000_003 + sent, mix or DEFAULT, max_new_tokens,
                        stats, next_at)
            sent += 1
            stats.sent = sent
    finally:
        # Requests still queued behind `concurrency` open streams (a rate above what the
        # server keeps up with) are dropped: the sampling is over, draining them could take
        # longer than the soak itself. Open streams finish.
        pool.shutdown(wait=True, cancel_futures=True)
    return sent
