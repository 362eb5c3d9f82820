"""Serving-benchmark metrics with vLLM's definitions, labels and JSON keys.

Everything here is a pure function of per-request records, so the figures can be checked
against hand-computed traces without a server. Definitions (all per successful request):

* TTFT: first token chunk time − send time.
* TPOT: (E2EL − TTFT) / (output tokens − 1), only for requests with at least 2 tokens; it
  excludes the first token, whose latency is prefill plus queueing.
* ITL: the gaps between successive token-carrying chunks. With multi-step streaming a chunk
  can hold several tokens, so ITL can exceed TPOT; that is the point of reporting both.
* E2EL: last token chunk time − send time.

Failed requests count in `failed` and in the per-request lists of the JSON (with zeros, as
vLLM writes them) but never in latency statistics or token totals.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Percentiles that always land in the JSON; the printed block shows `print_percentiles`.
JSON_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
PRINT_PERCENTILES: tuple[float, ...] = (99.0,)

TITLE = " Serving Benchmark Result "
WIDTH = 50
# (key in the JSON, short name on the lines, section header): vLLM's order and wording.
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass
class RequestRecord:
    """What one request did, on the client's clock (`time.perf_counter()` seconds)."""

    send_time: float
    success: bool = False
    input_tokens: int = 0
    # The authoritative generated-token count (server's cumulative count or usage); it can
    # differ from sum(chunk_tokens) when a backend cannot count tokens per chunk.
    output_tokens: int = 0
    # One entry per streamed chunk that carried at least one new output token.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # When the stream ended (last message, success or not).
    end_time: float = 0.0
    error: str = ""
    generated_text: str = ""

    def add_chunk(self, t: float, n_tokens: int) -> None:
        self.chunk_times.append(t)
        self.chunk_tokens.append(n_tokens)

    @property
    def ttft(self) -> float:
        """Seconds to the first token; 0.0 when none arrived (vLLM's placeholder)."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        """E2EL in seconds: to the last token, or to the stream's end without any token."""
        if self.chunk_times:
            return self.chunk_times[-1] - self.send_time
        return max(self.end_time - self.send_time, 0.0)

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(values_s: Sequence[float], prefix: str,
              percentiles: Iterable[float] = JSON_PERCENTILES) -> dict[str, float]:
    """mean/median/std/pNN of `values_s` (seconds) in ms, under vLLM's `{stat}_{prefix}_ms` keys.

    An empty list gives zeros, as vLLM's `np.mean(x or 0)` does, so the block always prints.
    """
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{prefix}_ms": float(np.mean(arr)),
        f"median_{prefix}_ms": float(np.median(arr)),
        f"std_{prefix}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        # numpy's default linear interpolation is what vLLM reports.
        out[f"p{_percentile_key(p)}_{prefix}_ms"] = float(np.percentile(arr, p))
    return out


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Most output tokens in any 1-second bucket, and the most requests active in a bucket.

    Buckets start at the first send time. Unlike vLLM, which assumes one token per chunk,
    each chunk counts the tokens it really carried.
    """
    ok = [r for r in records if r.success and r.chunk_times]
    if not ok:
        return 0.0, 0
    t0 = min(r.send_time for r in ok)
    t1 = max(r.chunk_times[-1] for r in ok)
    n = int(math.floor(t1 - t0)) + 1
    tokens = np.zeros(n)
    active = np.zeros(n, dtype=np.int64)
    for r in ok:
        for t, k in zip(r.chunk_times, r.chunk_tokens, strict=True):
            tokens[min(int(t - t0), n - 1)] += k
        active[int(r.send_time - t0): int(r.chunk_times[-1] - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(records: Sequence[RequestRecord], duration_s: float,
                      percentiles: Iterable[float] = JSON_PERCENTILES) -> dict[str, Any]:
    """The result dict with vLLM's key names (plus `input_throughput`, `failed`)."""
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.success]
    total_input = sum(r.input_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")
    ttfts = [r.ttft for r in ok if r.chunk_times]
    tpots = [tp for tp in (r.tpot for r in ok) if tp is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    peak_tok_s, peak_active = peak_output_rate(records)

    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_input / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "max_output_tokens_per_s": peak_tok_s,
        "max_concurrent_requests": peak_active,
    }
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(summarize(values, key, percentiles))
    # Per-request lists cover failed requests too (zeros), so index i is request i.
    result["input_lens"] = [r.input_tokens for r in records]
    result["output_lens"] = [r.output_tokens if r.success else 0 for r in records]
    result["ttfts"] = [r.ttft if r.success else 0.0 for r in records]
    result["itls"] = [r.itl if r.success else [] for r in records]
    result["generated_texts"] = [r.generated_text for r in records]
    result["errors"] = [r.error for r in records]
    return result


def _line(label: str, value: Any, fmt: str = "") -> str:
    # vLLM's "{:<40} {:<10}" / "{:<40} {:<10.2f}", trailing padding included, so blocks
    # from both tools line up character for character when pasted side by side.
    return f"{label:<40} {value:<10{fmt}}"


def format_result(result: dict[str, Any],
                  percentiles: Iterable[float] = PRINT_PERCENTILES,
                  max_concurrency: int | None = None,
                  request_rate: float | str | None = None) -> str:
    """The printed block, line for line as vLLM's serving benchmark prints it.

    `max_concurrency` / `request_rate` default to the values stored in `result` (if any); the
    "Maximum request concurrency" line appears only when a limit was set and the
    "Request rate configured" line only for a finite rate, as in vLLM.
    """
    if max_concurrency is None:
        max_concurrency = result.get("max_concurrency")
    if request_rate is None:
        request_rate = result.get("request_rate", "inf")
    rate = float(request_rate)
    lines = [f"{TITLE:=^{WIDTH}}",
             _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result.get("failed", 0))]
    if max_concurrency:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if math.isfinite(rate):
        lines.append(_line("Request rate configured (RPS):", rate, ".2f"))
    lines += [
        _line("Benchmark duration (s):", result["duration"], ".2f"),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", result["request_throughput"], ".2f"),
        _line("Input token throughput (tok/s):", result["input_throughput"], ".2f"),
        _line("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
        _line("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f"),
    ]
    for key, name, header in SECTIONS:
        lines.append(f"{header:-^{WIDTH}}")
        lines.append(_line(f"Mean {name} (ms):", result[f"mean_{key}_ms"], ".2f"))
        lines.append(_line(f"Median {name} (ms):", result[f"median_{key}_ms"], ".2f"))
        for p in percentiles:
            pk = _percentile_key(p)
            value = result.get(f"p{pk}_{key}_ms")
            if value is None:  # a percentile the JSON was not computed with
                continue
            lines.append(_line(f"P{pk} {name} (ms):", value, ".2f"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)
