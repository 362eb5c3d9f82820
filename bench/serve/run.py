"""Running one `tandem bench serve` workload: the dataset, Poisson arrivals through at most
`max_concurrency` slots, the progress line, and the result dict (vLLM's keys)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TextIO

from tandem_serve.bench.serve import guided_load, replicas
from tandem_serve.bench.serve.backends.base import Backend
from tandem_serve.bench.serve.backends.registry import make_backend
from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.datasets import (
    BenchItem,
    arrival_offsets,
    dataset_rng,
    load_dataset,
    multi_turn_dataset,
)
from tandem_serve.bench.serve.metrics import JSON_PERCENTILES, RequestRecord, calculate_metrics


class _ProgressLine:
    """"done/total, tok/s" on stderr about once a second while the run goes on."""

    def __init__(self, backend: Backend, total: int, interval: float, stream: TextIO) -> None:
        self.backend = backend
        self.total = total
        self.interval = interval
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()

    def render(self) -> str:
        p = self.backend.progress
        elapsed = time.perf_counter() - self.t0
        rate = p.output_tokens / elapsed if elapsed > 0 else 0.0
        failed = f", {p.failed} failed" if p.failed else ""
        return (f"[bench] {p.done}/{self.total} requests{failed}, {p.output_tokens} tokens, "
                f"{rate:.1f} tok/s, {elapsed:.0f} s")

    def write(self, final: bool = False) -> None:
        line = self.render()
        # A terminal gets one line rewritten in place; a log file gets one line per update.
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.write()


async def _send_all(backend: Backend, items: Sequence[BenchItem], offsets: Sequence[float],
                    max_concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """Send `items` at `offsets` (s after start) through at most `max_concurrency` slots.

    A request's send time is taken when it gets a slot, as vLLM does, so time spent waiting
    for the client's own limit is not charged to the server.
    """
    limit: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext())
    progress = backend.progress

    async def one(item: BenchItem) -> RequestRecord:
        async with limit:
            try:
                rec = await backend.run_one(item)
            except Exception as e:  # backends report failures; this is the last guard
                now = time.perf_counter()
                rec = RequestRecord(send_time=now, end_time=now, input_tokens=item.prompt_len,
                                    error=f"{type(e).__name__}: {e}")
        progress.done += 1
        if not rec.success:
            progress.failed += 1
        return rec

    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for item, offset in zip(items, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(item)))
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - start


def load_tokenizer(config: BenchConfig) -> Any:
    if not config.model:
        return None
    from tandem_serve.tokenization.tokenizer import Tokenizer

    return Tokenizer.from_dir(config.model)


def _resolve_model(config: BenchConfig) -> BenchConfig:
    """Without --model, use the embedded tiny model the server defaults to."""
    if config.model:
        return config
    needs_model = config.dataset != "file" or config.backend == "hf-generate"
    if not needs_model:
        return config
    from tandem_serve.harness.tiny_model import ensure_default_model

    return dataclasses.replace(config, model=str(ensure_default_model()))


def _note(msg: str, stream: TextIO | None) -> None:
    if stream is not None:
        print(msg, file=stream, flush=True)


def build_dataset(config: BenchConfig, tokenizer: Any, *, warmup: bool = False
                  ) -> list[BenchItem]:
    """The run's requests (or, `warmup`, its `config.warmup` warm-up requests)."""
    if config.dataset == "multi-turn" and tokenizer is not None:  # --turns is its own
        return multi_turn_dataset(tokenizer, config.warmup if warmup else config.num_prompts,
                                  config.prefix_len, config.input_len, config.output_len,
                                  config.turns, dataset_rng(config.seed, warmup))
    return load_dataset(config.dataset, tokenizer,
                        num_prompts=config.warmup if warmup else config.num_prompts,
                        input_len=config.input_len, output_len=config.output_len,
                        range_ratio=config.range_ratio, prefix_len=config.prefix_len,
                        dataset_path=config.dataset_path, seed=config.seed, warmup=warmup)


async def run_benchmark(config: BenchConfig, *, items: Sequence[BenchItem] | None = None,
                        backend: Backend | None = None, tokenizer: Any = None,
                        log_stream: TextIO | None = None) -> dict[str, Any]:
    """Run one benchmark; return the result JSON dict (vLLM's keys plus the run's settings).

    `items` / `backend` / `tokenizer` replace what `config` would build (tests pass a fake
    backend; the A/B driver can reuse one dataset for both arms). Settings and the progress
    line go to `log_stream` (nothing when None).
    """
    if items is None:
        config = _resolve_model(config)
        if tokenizer is None:
            tokenizer = load_tokenizer(config)
        items = build_dataset(config, tokenizer)
    if not items:
        raise ValueError("no requests to send (--num-prompts 0?)")
    if config.guided:
        if config.backend != "tandem" and backend is None:
            raise ValueError(f"--guided needs --backend tandem, not {config.backend}")
        items = guided_load.apply(items, config.guided, config.guided_share, config.seed)
    if config.adapters and config.backend != "tandem":
        raise ValueError(f"--adapters: the {config.backend} backend cannot name LoRA adapters")
    if config.replica_urls and config.backend == "hf-generate":
        raise ValueError("--replica-url: hf-generate runs in this process, behind no router")
    warmup_items: list[BenchItem] = []
    if config.warmup > 0:
        if config.dataset == "file" or tokenizer is None:
            warmup_items = [items[i % len(items)] for i in range(config.warmup)]
        else:
            warmup_items = build_dataset(config, tokenizer, warmup=True)

    if backend is None:
        if config.backend == "hf-generate" and math.isfinite(config.request_rate):
            _note("note: hf-generate batches whatever has arrived when the model is free",
                  log_stream)
        backend = make_backend(config.backend, config.backend_options(), tokenizer)
    watch = replicas.ReplicaWatch(config.replica_urls)
    await backend.start()
    try:
        await watch.start()
        if warmup_items:
            _note(f"Warming up with {len(warmup_items)} requests...", log_stream)
            await _send_all(backend, warmup_items, [0.0] * len(warmup_items),
                            config.max_concurrency)
            await watch.after_warmup()
        backend.progress.reset()  # warm-up traffic stays out of the progress figures
        offsets = arrival_offsets(len(items), config.request_rate, config.seed)
        rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
        _note(f"Traffic request rate: {rate}", log_stream)
        _note(f"Maximum request concurrency: {config.max_concurrency}", log_stream)
        line = None
        ticker = None
        if log_stream is not None and config.progress:
            line = _ProgressLine(backend, len(items), config.progress_interval, log_stream)
            ticker = asyncio.create_task(line.run())
        try:
            records, duration = await _send_all(backend, items, offsets, config.max_concurrency)
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
        if line is not None:
            line.write(final=True)
    finally:
        await backend.close()
    counts = await watch.finish()

    percentiles = tuple(sorted(set(JSON_PERCENTILES) | set(config.metric_percentiles)))
    result = calculate_metrics(records, duration, percentiles)
    if config.guided:
        result.update(guided_load.summary(items, records, config.guided, config.guided_share))
    if counts:
        result.update(replicas.summary(counts))
    result.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": config.backend,
        "model_id": config.model,
        "dataset": config.dataset,
        "num_prompts": len(items),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency,
        "seed": config.seed,
    })
    return result
