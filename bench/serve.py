"""`tandem bench serve`: vLLM's serving benchmark, pointed at Tandem's gRPC API (or at any
OpenAI-compatible HTTP server: `--backend openai-completions|openai-chat --base-url URL`).

It builds a seeded workload (`bench.datasets`), sends it to a backend
(`bench.backends`) with Poisson arrivals and an optional concurrency cap, and prints
the result block people paste side by side (`bench.metrics.format_result`) on stdout;
the progress line and the run's settings go to stderr, so stdout is the block alone.

    tandem bench serve --backend tandem --model DIR --dataset random \\
        --input-len 512 --output-len 128 --num-prompts 200 --request-rate 10

`run_benchmark(config)` is the same run for tests and the A/B driver: it returns the JSON
dict (vLLM's keys) and prints nothing unless asked.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TextIO

from tandem_serve.bench import guided as bench_guided
from tandem_serve.bench.backends import BACKENDS, Backend, BackendOptions, make_backend
from tandem_serve.bench.datasets import DATASETS, BenchItem, arrival_offsets, load_dataset
from tandem_serve.bench.metrics import (
    JSON_PERCENTILES,
    PRINT_PERCENTILES,
    RequestRecord,
    calculate_metrics,
    format_result,
)

DEFAULT_PORTS = {"tandem": 8033, "openai-completions": 8000, "openai-chat": 8000,
                 "transformers-serve": 8000, "hf-generate": 0}
# hf-generate's static batch size when --max-concurrency is not given.
DEFAULT_HF_BATCH = 16


@dataclass
class BenchConfig:
    """Every knob of one run; `config_from_args` fills it from the command line."""

    backend: str = "tandem"
    host: str = "127.0.0.1"
    port: int = 0  # 0: the backend's usual port
    model: str = ""
    served_model_name: str = ""
    base_url: str = ""
    endpoint: str = ""
    dataset: str = "random"
    dataset_path: str = ""
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    sample: bool = False
    temperature: float = 1.0
    warmup: int = 0
    request_timeout: float | None = None
    ready_timeout: float = 0.0
    metric_percentiles: tuple[float, ...] = PRINT_PERCENTILES
    output_json: str = ""
    progress: bool = True
    progress_interval: float = 1.0
    device: str = "auto"
    dtype: str = "float32"
    guided: str = ""  # a bench.guided kind: that share of the requests is constrained
    guided_share: float = 0.5
    adapters: list[str] = field(default_factory=list)  # LoRA adapter ids, request i: i % n

    def backend_options(self) -> BackendOptions:
        return BackendOptions(
            host=self.host, port=self.port or DEFAULT_PORTS.get(self.backend, 0),
            model=self.model, served_model_name=self.served_model_name,
            base_url=self.base_url, endpoint=self.endpoint, logprobs=self.logprobs,
            stop=list(self.stop),
            sample=self.sample, temperature=self.temperature, seed=self.seed,
            request_timeout=self.request_timeout, ready_timeout=self.ready_timeout,
            batch_size=self.max_concurrency or DEFAULT_HF_BATCH, device=self.device,
            dtype=self.dtype, adapters=list(self.adapters))


# --------------------------------------------------------------------------- CLI


def _rate(value: str) -> float:
    rate = float(value)  # float("inf") parses "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {value}")
    return rate


def _adapters(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def _percentiles(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(p) for p in value.split(",") if p.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad percentile list {value!r}") from e
    if not out or any(not 0 < p <= 100 for p in out):
        raise argparse.ArgumentTypeError("percentiles must be in (0, 100]")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tandem bench serve` (vLLM's names where vLLM has the same knob)."""
    d = BenchConfig()
    env_model = os.environ.get("TANDEM_MODEL", "")
    g = parser.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="tandem: gRPC GenerateStream; openai-completions / openai-chat: any "
                        "OpenAI-compatible server at --base-url (SSE); transformers-serve: "
                        "its /v1/completions; hf-generate: in-process static batches")
    g.add_argument("--host", default=os.environ.get("TANDEM_HOST") or d.host)
    g.add_argument("--port", type=int, default=d.port,
                   help="default: 8033 for tandem, 8000 for the HTTP backends")
    g.add_argument("--base-url", default=d.base_url,
                   help="HTTP backends: the server's root, e.g. http://127.0.0.1:8000 "
                        "(default: http://--host:--port)")
    g.add_argument("--model", default=env_model,
                   help="model folder: tokenizer for the datasets, weights for hf-generate "
                        "(default: $TANDEM_MODEL, else the embedded tiny model)")
    g.add_argument("--served-model-name", default=d.served_model_name,
                   help="'model' field of OpenAI requests (default: --model)")
    g.add_argument("--endpoint", default=d.endpoint,
                   help="OpenAI endpoint path (default: /v1/completions, or "
                        "/v1/chat/completions for openai-chat)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds before one request counts as failed")
    g.add_argument("--ready-timeout", type=float, default=d.ready_timeout,
                   help="wait up to this long for the server to be ready first (gRPC health "
                        "SERVING, or HTTP /health 200)")
    g.add_argument("--device", default=d.device, help="hf-generate: auto, cpu, cuda")
    g.add_argument("--dtype", default=d.dtype, help="hf-generate: float32, bfloat16, ...")

    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    g.add_argument("--dataset-path", default="", help="JSONL file for --dataset file")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--input-len", type=int, default=d.input_len,
                   help="prompt tokens (shared-prefix: of the suffix)")
    g.add_argument("--output-len", type=int, default=d.output_len,
                   help="generated tokens per request (min = max, so EOS cannot end early)")
    g.add_argument("--range-ratio", type=float, default=d.range_ratio,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=d.prefix_len,
                   help="shared-prefix: tokens every prompt starts with")
    g.add_argument("--seed", type=int, default=d.seed)

    g = parser.add_argument_group("traffic")
    g.add_argument("--request-rate", type=_rate, default=d.request_rate,
                   help="requests/s with Poisson arrivals; inf sends all at once")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (hf-generate: the static batch size, "
                        f"default {DEFAULT_HF_BATCH})")
    g.add_argument("--warmup", type=int, default=d.warmup,
                   help="requests sent first and not counted")

    g = parser.add_argument_group("request load")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="ask for token text, logprob and top-N alternatives per token")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop sequence (repeatable)")
    g.add_argument("--sample", action="store_true",
                   help="sample (seed + request index) instead of greedy")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="with --sample")
    g.add_argument("--guided", choices=bench_guided.KINDS, default=d.guided,
                   help="tandem: constrain --guided-share of the requests (phone-number "
                        "regex, colour choice, person JSON schema, sum grammar, any JSON "
                        "object); the first one's TTFT (a cold compile) is reported apart")
    g.add_argument("--guided-share", type=float, default=d.guided_share,
                   help="with --guided: the share of requests, in (0, 1]")
    g.add_argument("--adapters", type=_adapters, default=[], metavar="A,B,...",
                   help="tandem: LoRA adapter ids the requests spread over (request i uses "
                        "adapter i mod n; the server needs --adapter-cache)")

    g = parser.add_argument_group("output")
    g.add_argument("--output-json", default="", metavar="FILE",
                   help="write the result JSON (vLLM's keys) here")
    g.add_argument("--metric-percentiles", type=_percentiles, default=d.metric_percentiles,
                   help="comma-separated percentiles to print (default 99)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress line on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})


# ----------------------------------------------------------------------- running


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


def _load_tokenizer(config: BenchConfig) -> Any:
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
    from tandem_serve.gpu_worker.tiny_model import ensure_default_model

    return dataclasses.replace(config, model=str(ensure_default_model()))


def _note(msg: str, stream: TextIO | None) -> None:
    if stream is not None:
        print(msg, file=stream, flush=True)


def build_dataset(config: BenchConfig, tokenizer: Any, *, warmup: bool = False
                  ) -> list[BenchItem]:
    """The run's requests (or, `warmup`, its `config.warmup` warm-up requests)."""
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
            tokenizer = _load_tokenizer(config)
        items = build_dataset(config, tokenizer)
    if not items:
        raise ValueError("no requests to send (--num-prompts 0?)")
    if config.guided:
        if config.backend != "tandem" and backend is None:
            raise ValueError(f"--guided needs --backend tandem, not {config.backend}")
        items = bench_guided.apply(items, config.guided, config.guided_share, config.seed)
    if config.adapters and config.backend != "tandem":
        raise ValueError(f"--adapters: the {config.backend} backend cannot name LoRA adapters")
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
    await backend.start()
    try:
        if warmup_items:
            _note(f"Warming up with {len(warmup_items)} requests...", log_stream)
            await _send_all(backend, warmup_items, [0.0] * len(warmup_items),
                            config.max_concurrency)
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

    percentiles = tuple(sorted(set(JSON_PERCENTILES) | set(config.metric_percentiles)))
    result = calculate_metrics(records, duration, percentiles)
    if config.guided:
        result.update(bench_guided.summary(items, records, config.guided, config.guided_share))
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


def main(args: argparse.Namespace) -> int:
    """Entry point of `tandem bench serve`; 0 when at least one request succeeded."""
    config = config_from_args(args)
    try:
        result = asyncio.run(run_benchmark(config, log_stream=sys.stderr))
    except (ValueError, OSError, TimeoutError) as e:
        print(f"tandem bench serve: {e}", file=sys.stderr)
        return 2
    print(format_result(result, config.metric_percentiles))
    if config.guided:
        print(bench_guided.format_summary(result))
    if config.output_json:
        with open(config.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {config.output_json}", file=sys.stderr)
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
