"""The vLLM-named metrics on scripted requests and scheduler reports: every family with vLLM's
type, labels and buckets, values that move by exactly what the requests carried, and servers
in one process that do not share anything."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem_serve.frontend import metrics as tandem_metrics
from tandem_serve.frontend.vllm_metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    VllmMetrics,
)
from tandem_serve.proto.monitor_messages import EngineStats
from tandem_serve.proto.plan_messages import WorkerReady
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta

# Exposition name (prometheus_client drops a counter's _total from the family) -> type.
FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge", "vllm:lora_requests_info": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter",
    "vllm:external_prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
MODEL = {"model_name": "tiny", "engine": "0"}


def parsed(m: VllmMetrics) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    text = generate_latest(m.registry).decode()
    # prometheus_client's *_created series (the time a counter started) are beside the point.
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def value(m: VllmMetrics, sample: str, **labels: str) -> float:
    want = {**MODEL, **labels}
    for _, samples in parsed(m).values():
        for name, got, v in samples:
            if name == sample and got == want:
                return v
    raise KeyError(f"{sample} {want}")


def stats(**kw: object) -> EngineStats:
    base: dict[str, object] = dict(num_free_blocks=100, num_total_blocks=100, num_running=0,
                                   num_waiting=0, num_preemptions=0, prefix_hit_tokens=0,
                                   prefix_query_tokens=0, tokens_delivered=0,
                                   tokens_after_finish=0)
    return EngineStats(**{**base, **kw})  # type: ignore[arg-type]


def delta(n: int, reason: FinishReason = FinishReason.NOT_FINISHED) -> OutputDelta:
    return OutputDelta(1, "x", n, finish_reason=reason)


def test_every_family_has_vllms_type_labels_and_buckets() -> None:
    m = VllmMetrics("tiny", max_loras=4)
    m.on_ready(WorkerReady(num_kv_blocks=512, block_size=16, max_model_len=256, vocab_size=10))
    families = parsed(m)
    assert {name: kind for name, (kind, _) in families.items()} == FAMILIES
    for name, (_, samples) in families.items():
        if name == "vllm:cache_config_info":
            assert samples == [(name, {"block_size": "16", "enable_prefix_caching": "True",
                                       "engine": "0", "num_gpu_blocks": "512"}, 1.0)]
        elif name == "vllm:lora_requests_info":
            [(_, labels, _)] = samples
            assert labels == {"max_lora": "4", "running_lora_adapters": "",
                              "waiting_lora_adapters": ""}
        elif name == "vllm:request_success":
            assert [(s, labels["finished_reason"]) for s, labels, _ in samples
                    if s.endswith("_total")] == [("vllm:request_success_total", r)
                                                 for r in ("stop", "length", "abort")]
        else:
            assert all({k: v for k, v in labels.items() if k != "le"} == MODEL
                       for _, labels, _ in samples), name
    buckets = {name: [float(labels["le"]) for s, labels, _ in samples if s.endswith("_bucket")]
               for name, (kind, samples) in families.items() if kind == "histogram"}
    assert buckets == {"vllm:time_to_first_token_seconds": [*TTFT_BUCKETS, float("inf")],
                       "vllm:inter_token_latency_seconds": [*ITL_BUCKETS, float("inf")],
                       "vllm:e2e_request_latency_seconds": [*E2E_BUCKETS, float("inf")]}
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0
    assert ITL_BUCKETS[0] == 0.01 and E2E_BUCKETS[-1] == 7680.0
    # Without --adapter-cache there is no LoRA family, as vLLM without LoRA.
    assert "vllm:lora_requests_info" not in parsed(VllmMetrics("tiny"))


def test_counters_move_by_exactly_what_the_requests_carried() -> None:
    m = VllmMetrics("tiny")
    # 7 prompt tokens; 1 token at 0.5 s, then 2 tokens 0.2 s later, then 1 and the finish.
    a = m.request(7, arrived=10.0)
    a.on_delta(delta(1), 10.5)
    a.on_delta(delta(3), 10.7)
    a.on_delta(delta(4, FinishReason.MAX_TOKENS), 10.8)
    # 5 prompt tokens, EOS after 2 tokens that came in one delta.
    b = m.request(5, arrived=20.0)
    b.on_delta(delta(2, FinishReason.EOS_TOKEN), 20.25)
    # 3 prompt tokens, 1 token, then its client leaves.
    c = m.request(3, arrived=30.0)
    c.on_delta(delta(1), 30.1)
    c.on_abort(31.0)
    # A time limit: the frontend's own final delta carries no token count.
    d = m.request(2, arrived=40.0)
    d.on_delta(delta(1), 40.1)
    d.on_delta(OutputDelta(1, "", -1, finish_reason=FinishReason.TIME_LIMIT), 40.2)
    # Rejected before the engine answered: nothing at all.
    m.request(100, arrived=50.0)
    assert value(m, "vllm:prompt_tokens_total") == 7 + 5 + 3 + 2
    assert value(m, "vllm:generation_tokens_total") == 4 + 2 + 1 + 1
    assert [value(m, "vllm:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort")] == [1, 2, 1]
    assert value(m, "vllm:time_to_first_token_seconds_count") == 4
    assert abs(value(m, "vllm:time_to_first_token_seconds_sum") - (0.5 + 0.25 + 0.1 + 0.1)) \
        < 1e-9
    # One per token after the first: 0.1, 0.1 (the 0.2 s gap over 2 tokens), then 0.1.
    assert value(m, "vllm:inter_token_latency_seconds_count") == 3
    assert abs(value(m, "vllm:inter_token_latency_seconds_sum") - 0.3) < 1e-9
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.075") == 0
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.15") == 3
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 4
    assert abs(value(m, "vllm:e2e_request_latency_seconds_sum") - (0.8 + 0.25 + 1.0 + 0.2)) \
        < 1e-9
    c.on_abort(32.0)  # an end is counted once
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1


def test_gauges_and_prefix_counters_follow_the_schedulers_reports() -> None:
    m = VllmMetrics("tiny", max_loras=2)
    m.on_stats(stats(num_running=3, num_waiting=2, num_free_blocks=75,
                     prefix_query_tokens=40, prefix_hit_tokens=16,
                     running_adapters=["a", "b"], waiting_adapters=["c"]))
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 2
    assert value(m, "vllm:kv_cache_usage_perc") == value(m, "vllm:gpu_cache_usage_perc") == 0.25
    [(_, labels, stamp)] = parsed(m)["vllm:lora_requests_info"][1]
    assert labels == {"max_lora": "2", "running_lora_adapters": "a,b",
                      "waiting_lora_adapters": "c"}
    assert stamp > 1.7e9  # when it was set, as vLLM's: pickers read the newest series
    m.on_stats(stats(prefix_query_tokens=100, prefix_hit_tokens=48))
    assert (value(m, "vllm:prefix_cache_queries_total"),
            value(m, "vllm:prefix_cache_hits_total")) == (100, 48)
    assert len(parsed(m)["vllm:lora_requests_info"][1]) == 1  # the old sets do not pile up
    # The roles behind the frontend were replaced: the new scheduler counts from 0.
    m.on_stats(stats(prefix_query_tokens=10, prefix_hit_tokens=0))
    m.on_stats(stats(prefix_query_tokens=30, prefix_hit_tokens=16))
    assert (value(m, "vllm:prefix_cache_queries_total"),
            value(m, "vllm:prefix_cache_hits_total")) == (130, 64)
    m.on_ready(WorkerReady(num_kv_blocks=64, block_size=16, max_model_len=256, vocab_size=10))
    m.on_ready(WorkerReady(num_kv_blocks=80, block_size=16, max_model_len=256, vocab_size=10))
    assert [labels["num_gpu_blocks"] for _, labels, _ in
            parsed(m)["vllm:cache_config_info"][1]] == ["80"]


def test_the_host_tier_is_vllms_external_prefix_cache() -> None:
    m = VllmMetrics("tiny")
    m.on_stats(stats(external_query_tokens=200, external_hit_tokens=160))
    m.on_stats(stats(external_query_tokens=300, external_hit_tokens=176))
    assert (value(m, "vllm:external_prefix_cache_queries_total"),
            value(m, "vllm:external_prefix_cache_hits_total")) == (300, 176)
    m.on_stats(stats(external_query_tokens=20, external_hit_tokens=16))  # a new scheduler
    assert (value(m, "vllm:external_prefix_cache_queries_total"),
            value(m, "vllm:external_prefix_cache_hits_total")) == (320, 192)


def test_servers_in_one_process_share_nothing() -> None:
    one, two = VllmMetrics("tiny"), VllmMetrics("tiny")
    r = one.request(4, arrived=0.0)
    r.on_delta(delta(1, FinishReason.MAX_TOKENS), 0.1)
    assert value(one, "vllm:prompt_tokens_total") == 4
    assert value(two, "vllm:prompt_tokens_total") == 0


def test_the_exposition_shows_both_the_tandem_and_the_vllm_metrics() -> None:
    m = VllmMetrics("tiny")
    text = generate_latest(tandem_metrics.exposition(m.registry)).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"tandem_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
            "vllm:request_success"} <= names
    # A scrape asking for some series only (Prometheus' name[] parameter) still works.
    restricted = tandem_metrics.exposition(m.registry).restricted_registry(
        ["vllm:prompt_tokens_total"])
    assert b"vllm:prompt_tokens_total{" in generate_latest(restricted)
