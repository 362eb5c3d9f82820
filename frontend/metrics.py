"""Prometheus metrics of the frontend (`--metrics-port`), fed by the request streams and the
scheduler's periodic EngineStats, so one endpoint covers every process."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.metrics_core import Metric

from tandem_serve.proto.monitor_messages import EngineStats, PostprocStats

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# A request that finds room waits for the next plan only: milliseconds, so finer low buckets.
_QUEUE = (0.001, 0.0025, *_LATENCY)

TTFT = Histogram("tandem_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY)
ITL = Histogram("tandem_inter_token_latency_seconds", "Gap between streamed deltas",
                buckets=_LATENCY)
E2E = Histogram("tandem_e2e_request_latency_seconds", "Arrival to last token",
                buckets=_LATENCY)
REQUESTS = Counter("tandem_requests_total", "Finished requests", ["reason"])
REJECTED = Counter("tandem_rejected_requests_total", "Requests refused by admission control")
SLOW_CLIENTS = Counter("tandem_slow_client_cancels_total",
                       "Requests cancelled because their client stopped reading "
                       "(--max-stream-buffer-bytes)")
RUNNING = Gauge("tandem_num_requests_running", "Requests holding KV blocks")
WAITING = Gauge("tandem_num_requests_waiting", "Queued requests (preempted included)")
KV_USAGE = Gauge("tandem_kv_cache_usage_ratio", "Share of KV blocks in use")
PREFIX_HIT = Gauge("tandem_prefix_cache_hit_ratio", "Prompt tokens served from the cache")
HOST_TIER_USAGE = Gauge("tandem_kv_offload_usage_ratio",
                        "Share of the host KV tier's blocks in use (--kv-offloading-size)")
HOST_TIER_BLOCKS = Gauge("tandem_kv_offload_blocks", "Blocks the host KV tier holds in all")
PREEMPTIONS = Gauge("tandem_num_preemptions", "Preemptions since start")
DEVICE_BUSY = Gauge("tandem_device_busy_ratio", "Gpu worker time inside plans / uptime")
WASTED = Gauge("tandem_tokens_after_finish", "Tokens computed after a request finished")
QUEUE_TIME = Histogram("tandem_queue_time_seconds", "Arrival to first scheduling",
                       buckets=_QUEUE)
LOADED_ADAPTERS = Gauge("tandem_lora_loaded_adapters",
                        "LoRA adapters resident in the gpu worker's adapter slots")
ADAPTER_LOADS = Gauge("tandem_lora_adapter_loads", "Adapter loads into slots since start "
                      "(more than the adapters used: evictions made room)")
ADAPTER_REQUESTS = Counter("tandem_lora_requests_total", "Requests per LoRA adapter",
                           ["adapter"])
GUIDED_SENT = Counter("tandem_guided_tables_sent_total",
                      "Compiled guided constraints sent to the scheduler, once per id "
                      "(first) and again when it lacked one (asked)", ["why"])
SPEC_DRAFTS = Counter("tandem_spec_decode_num_drafts",
                      "Speculative decoding: row-steps verified with a draft")
SPEC_DRAFT_TOKENS = Counter("tandem_spec_decode_num_draft_tokens",
                            "Speculative decoding: draft tokens proposed")
SPEC_ACCEPTED = Counter("tandem_spec_decode_num_accepted_tokens",
                        "Speculative decoding: draft tokens accepted")
SPEC_ACCEPTED_AT = Counter("tandem_spec_decode_num_accepted_tokens_per_pos",
                           "Speculative decoding: draft tokens accepted, by draft position "
                           "(0: the first draft)", ["position"])
PROCESS_BUSY = Counter("tandem_process_busy_seconds",
                       "Seconds busy since start, by process: the gpu worker inside plans, a "
                       "postproc worker (the average over them) on its token batches; the "
                       "frontend's own is process_cpu_seconds_total", ["process"])
_busy_seen: dict[str, float] = {}  # the totals PROCESS_BUSY holds, by process
_spec_seen = [0, 0, 0]  # the totals the counters hold (EngineStats carries totals)
_spec_seen_at: list[int] = []
POSTPROC_LAG = Gauge("tandem_postproc_lag_steps",
                     "Steps published by the gpu worker and not yet processed, the most over "
                     "the postproc workers' latest reports")

_lag_by_worker: dict[int, int] = {}


class _Both:
    """A collector of every metric of several registries, for one exposition."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        for registry in self._registries:
            yield from registry.collect()

    def describe(self) -> list[Metric]:
        return []  # the registries checked their own names: nothing to check twice


def exposition(server: CollectorRegistry) -> CollectorRegistry:
    """What /metrics shows (on the HTTP port and `--metrics-port`): these tandem_* metrics,
    which live in prometheus_client's global registry, and the server's own registry (the
    vLLM-named metrics, `frontend/vllm_metrics.py`)."""
    # Without names to describe it by, a restricted scrape (?name[]=...) asks it too.
    both = CollectorRegistry(support_collectors_without_names=True)
    both.register(_Both(REGISTRY, server))
    return both


def serve_metrics(port: int, registry: CollectorRegistry = REGISTRY) -> None:
    if port:
        start_http_server(port, registry=registry)


def on_stats(s: EngineStats) -> None:
    RUNNING.set(s.num_running)
    WAITING.set(s.num_waiting)
    if s.num_total_blocks:
        KV_USAGE.set(1.0 - s.num_free_blocks / s.num_total_blocks)
    if s.prefix_query_tokens:
        PREFIX_HIT.set(s.prefix_hit_tokens / s.prefix_query_tokens)
    PREEMPTIONS.set(s.num_preemptions)
    if s.host_blocks_total:
        HOST_TIER_BLOCKS.set(s.host_blocks_total)
        HOST_TIER_USAGE.set(s.host_blocks_used / s.host_blocks_total)
    if s.uptime_s > 0:
        DEVICE_BUSY.set(min(1.0, s.worker_busy_s / s.uptime_s))
    WASTED.set(s.tokens_after_finish)
    LOADED_ADAPTERS.set(len(s.loaded_adapters))
    ADAPTER_LOADS.set(s.adapter_loads)
    for q in s.queue_times_s:
        QUEUE_TIME.observe(q)
    for process, total in (("gpu-worker", s.worker_busy_s), ("postproc", s.postproc_busy_s)):
        _count_busy(process, total)
    totals = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
    for i, (counter, total) in enumerate(zip((SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED),
                                             totals, strict=True)):
        if total > _spec_seen[i]:
            counter.inc(total - _spec_seen[i])
            _spec_seen[i] = total
    for j, total in enumerate(s.spec_num_accepted_per_pos):
        if j == len(_spec_seen_at):
            _spec_seen_at.append(0)
        if total > _spec_seen_at[j]:
            SPEC_ACCEPTED_AT.labels(position=str(j)).inc(total - _spec_seen_at[j])
            _spec_seen_at[j] = total


def _count_busy(process: str, total: float) -> None:
    seen = _busy_seen.get(process, 0.0)
    if total < seen:  # a new set of roles counts from 0 (roles on their own)
        seen = 0.0
    if total > seen:
        PROCESS_BUSY.labels(process).inc(total - seen)
    _busy_seen[process] = total


def on_postproc_stats(s: PostprocStats) -> None:
    # The slowest worker is the one that holds streams back.
    _lag_by_worker[s.index] = s.lag_steps
    POSTPROC_LAG.set(max(_lag_by_worker.values()))
