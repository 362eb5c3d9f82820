"""`tandem bench serve`: vLLM's serving benchmark, pointed at Tandem's gRPC API (or at any
OpenAI-compatible HTTP server: `--backend openai-completions|openai-chat --base-url URL`).

It builds a seeded workload (`datasets.py`), sends it to a backend (`backends/`) with
Poisson arrivals and an optional concurrency cap (`run.py`), and prints the result block
people paste side by side (`metrics.format_result`) on stdout; the progress line and the
run's settings go to stderr, so stdout is the block alone.

    tandem bench serve --backend tandem --model DIR --dataset random \\
        --input-len 512 --output-len 128 --num-prompts 200 --request-rate 10

Pointed at a router (`--base-url`), `--replica-url URL` (once per replica behind it) also
reports what each replica served, from its `/metrics` read before and after the run:
requests finished by reason, prompt and generation tokens, prefix-cache hits over queries.

`run.run_benchmark(config)` is the same run for tests and the A/B driver: it returns the
JSON dict (vLLM's keys) and prints nothing unless asked.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys

from tandem_serve.bench.serve import guided_load, replicas
from tandem_serve.bench.serve.backends.base import BACKENDS
from tandem_serve.bench.serve.config import DEFAULT_HF_BATCH, BenchConfig
from tandem_serve.bench.serve.datasets import DATASETS
from tandem_serve.bench.serve.metrics import format_result
from tandem_serve.bench.serve.run import run_benchmark


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
    g.add_argument("--replica-url", dest="replica_urls", action="append", default=[],
                   metavar="URL",
                   help="repeatable: the HTTP base URL of a replica behind the router at "
                        "--base-url; each one's /metrics is read before and after the run, "
                        "and its requests, tokens and prefix-cache hits are reported")
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
                   help="shared-prefix: tokens every prompt starts with; multi-turn: each "
                        "conversation's opening")
    g.add_argument("--turns", type=int, default=d.turns,
                   help="multi-turn: requests per conversation (each re-sends the "
                        "conversation so far plus about --input-len tokens)")
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
    g.add_argument("--guided", choices=guided_load.KINDS, default=d.guided,
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
        print(guided_load.format_summary(result))
    if "replicas" in result:
        print(replicas.format_summary(result))
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
