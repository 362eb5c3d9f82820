"""vLLM's Prometheus metrics, so dashboards, autoscalers and endpoint pickers written for vLLM
read Tandem unchanged: vLLM's names, types, units, labels (`model_name`, `engine="0"`) and
histogram buckets (vllm/v1/metrics/loggers.py), beside the `tandem_*` ones of
`frontend/metrics.py`.

Each server has its own registry (`VllmMetrics.registry`), not prometheus_client's global one:
the model name is a label known only once the server is configured, and two servers (or two
tests) in one process must not share counters.

What the metrics count, and where it differs from a plain reading:
- Requests are engine requests: a completion of p prompts with `n` choices counts p·n, each
  with its whole prompt (vLLM's child requests do the same), so with n = 1 the token counters
  move by exactly what the responses' `usage` says.  The frontend's warm-up is left out.
- `vllm:prompt_tokens` counts the whole prompt, its cached part included, once the engine
  answers the request; `vllm:generation_tokens` counts tokens as they arrive.
- Inter-token latency: one observation per generated token after the first, a delta's gap
  spread evenly over the tokens it carries (a delta of several tokens is one of several steps
  read at once, not one slow token).
- `finished_reason`: "stop" (EOS, a stop token or string), "length" (max_tokens, the model
  length, the time limit) and "abort" (the client went away, or the engine ended it with
  CANCELLED or ERROR): the `finish_reason` the HTTP API answers.  Every request that ends so
  is counted there once and observed once in the e2e histogram; one answered with an error
  status instead (admission's 429, a failed process, a client too slow to read) is in
  neither.  The prefix-cache counters include the warm-up's few prompt tokens.
- The gauges and prefix-cache counters follow the scheduler's reports (`EngineStats`, every
  0.2 s); `kv_cache_usage_perc` counts cached blocks no request holds as free, as vLLM does.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem_serve.proto.monitor_messages import EngineStats
from tandem_serve.proto.plan_messages import WorkerReady
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta

# vLLM's finish_reason strings; the HTTP API answers the same (openai_api/chat/shapes.py).
FINISH_REASON = {FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop",
                 FinishReason.MAX_TOKENS: "length", FinishReason.TOKEN_LIMIT: "length",
                 FinishReason.TIME_LIMIT: "length", FinishReason.CANCELLED: "abort",
                 FinishReason.ERROR: "abort"}
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's data-parallel engine index: one engine per Tandem server


class VllmMetrics:
    """One server's vLLM-named metrics in a registry of its own."""

    def __init__(self, model_name: str, max_loras: int = 0, prefix_caching: bool = True
                 ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._values = (model_name, ENGINE)
        self._prefix_caching = prefix_caching
        self.running = self._gauge("vllm:num_requests_running",
                                   "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting",
                                   "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = self._gauge(  # the name endpoint pickers before vLLM 0.9 read
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        # The host KV tier (--kv-offloading-size) is vLLM's "external" (connector) cache.
        self.external_queries = self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.")
        self.external_hits = self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens",
                                           "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens",
                                               "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*_LABELS, "finished_reason"], registry=self.registry)
        # Every reason from the start, at 0, as vLLM declares them: rate() needs the series.
        self.success = {r: success.labels(*self._values, r) for r in ("stop", "length", "abort")}
        self.ttft = self._histogram("vllm:time_to_first_token_seconds",
                                    "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds",
                                   "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds",
                                   "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self._cache_info = Gauge("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 ["block_size", "enable_prefix_caching", "engine",
                                  "num_gpu_blocks"], registry=self.registry)
        self._max_loras = max_loras
        self._lora_info: Gauge | None = None
        if max_loras:
            self._lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                    ["max_lora", "waiting_lora_adapters",
                                     "running_lora_adapters"], registry=self.registry)
            self._lora_requests([], [])
        self._prefix_seen = (0, 0)  # the scheduler's cumulative (queries, hits) last reported
        self._external_seen = (0, 0)  # likewise, the host tier's

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, _LABELS, registry=self.registry).labels(*self._values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, _LABELS, registry=self.registry).labels(*self._values)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, _LABELS, registry=self.registry,
                         buckets=buckets).labels(*self._values)

    # ------------------------------------------------------------------ engine reports

    def on_ready(self, msg: WorkerReady) -> None:
        """The KV cache's shape, known once the gpu worker allocated it (again after the
        roles behind the frontend were replaced)."""
        self._cache_info.clear()
        self._cache_info.labels(block_size=str(msg.block_size),
                                enable_prefix_caching=str(self._prefix_caching),
                                engine=ENGINE, num_gpu_blocks=str(msg.num_kv_blocks)).set(1)

    def on_stats(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        if s.num_total_blocks:
            usage = 1.0 - s.num_free_blocks / s.num_total_blocks
            self.kv_usage.set(usage)
            self.gpu_cache_usage.set(usage)
        queries, hits = self._prefix_seen
        if s.prefix_query_tokens < queries:  # a new scheduler counts from 0
            queries, hits = 0, 0
        self.prefix_queries.inc(s.prefix_query_tokens - queries)
        self.prefix_hits.inc(max(0, s.prefix_hit_tokens - hits))
        self._prefix_seen = (s.prefix_query_tokens, s.prefix_hit_tokens)
        queries, hits = self._external_seen
        if s.external_query_tokens < queries:
            queries, hits = 0, 0
        self.external_queries.inc(s.external_query_tokens - queries)
        self.external_hits.inc(max(0, s.external_hit_tokens - hits))
        self._external_seen = (s.external_query_tokens, s.external_hit_tokens)
        if self._lora_info is not None:
            self._lora_requests(s.running_adapters, s.waiting_adapters)

    def _lora_requests(self, running: list[str], waiting: list[str]) -> None:
        """vLLM's info gauge: the value is when it was set (pickers take the newest series);
        only the current series is kept, so old adapter sets do not pile up."""
        assert self._lora_info is not None
        self._lora_info.clear()
        self._lora_info.labels(max_lora=str(self._max_loras),
                               waiting_lora_adapters=",".join(waiting),
                               running_lora_adapters=",".join(running)).set(time.time())

    # ------------------------------------------------------------------ requests

    def request(self, prompt_tokens: int, arrived: float) -> RequestMeter:
        """What one engine request adds, fed with its deltas (`arrived`: time.monotonic())."""
        return RequestMeter(self, prompt_tokens, arrived)


class RequestMeter:
    """One engine request's share of the metrics."""

    __slots__ = ("_m", "_prompt_tokens", "_arrived", "_generated", "_answered", "_last_at",
                 "_ended")

    def __init__(self, metrics: VllmMetrics, prompt_tokens: int, arrived: float) -> None:
        self._m = metrics
        self._prompt_tokens = prompt_tokens
        self._arrived = arrived
        self._generated = 0
        self._answered = False
        self._last_at = arrived
        self._ended = False

    def on_delta(self, d: OutputDelta, now: float) -> None:
        m = self._m
        if not self._answered:  # the engine took the request: its prompt was processed
            self._answered = True
            m.prompt_tokens.inc(self._prompt_tokens)
        new = d.num_generated - self._generated if d.num_generated >= 0 else 0
        if new > 0:
            if self._generated == 0:
                m.ttft.observe(now - self._arrived)
            else:
                gap = (now - self._last_at) / new
                for _ in range(new):
                    m.itl.observe(gap)
            m.generation_tokens.inc(new)
            self._generated = d.num_generated
            self._last_at = now
        if d.finish_reason != FinishReason.NOT_FINISHED:
            self._end(FINISH_REASON[d.finish_reason], now)

    def on_abort(self, now: float) -> None:
        """The request ended without a finish from the engine (its client went away)."""
        self._end("abort", now)

    def _end(self, reason: str, now: float) -> None:
        if self._ended:
            return
        self._ended = True
        self._m.success[reason].inc()
        self._m.e2e.observe(now - self._arrived)
