"""deploy/grafana/tandem.json: every panel's PromQL parses (promql-parser, the Rust parser
GreptimeDB uses) and names only metrics the server exports, collected from the metric
registrations in code (the tandem_* ones, the process collector's, and the vLLM-named ones
of a server with every optional family on)."""
from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import promql_parser
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from tandem_serve.frontend import metrics  # noqa: F401 - registers the tandem_* metrics
from tandem_serve.frontend.vllm_metrics import VllmMetrics

DASHBOARD = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "tandem.json"
# Grafana's own variables, as Prometheus would see them once substituted.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum",
                                                             "_created"),
            "summary": ("_count", "_sum", "_created"), "info": ("_info",)}


def exported(*registries: CollectorRegistry) -> set[str]:
    """Every series name the registries expose, labelled families without children too."""
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
            names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def names() -> set[str]:
    server = VllmMetrics("m", max_loras=2, prefix_caching=True)
    return exported(REGISTRY, server.registry)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, expression) of every query, the variables' queries included."""
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            inner = var["query"]["query"]
            assert inner.startswith("label_values(") and inner.endswith(")")
            selector = inner[len("label_values("):-1].rsplit(",", 1)[0]
            yield f"variable {var['name']}", selector


def metric_names(node: Any) -> Iterator[str]:
    if isinstance(node, promql_parser.VectorSelector):
        yield node.name
    elif isinstance(node, promql_parser.MatrixSelector):
        yield from metric_names(node.vector_selector)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            yield from metric_names(arg)
    elif isinstance(node, promql_parser.BinaryExpr):
        yield from metric_names(node.lhs)
        yield from metric_names(node.rhs)
    elif isinstance(node, (promql_parser.AggregateExpr, promql_parser.ParenExpr,
                           promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        yield from metric_names(node.expr)


def problems(dash: dict[str, Any], known: set[str]) -> list[str]:
    out = []
    for title, expr in expressions(dash):
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        try:
            tree = promql_parser.parse(expr)
        except ValueError as exc:
            out.append(f"{title}: {expr!r} does not parse: {exc}")
            continue
        found = list(metric_names(tree))
        if not found:
            out.append(f"{title}: {expr!r} names no metric")
        out += [f"{title}: {name} is not a metric the server exports"
                for name in found if name not in known]
    return out


def test_every_expression_parses_and_names_an_exported_metric(names: set[str]) -> None:
    assert not problems(dashboard(), names)


def test_the_check_bites(names: set[str]) -> None:
    dash = dashboard()
    broken = copy.deepcopy(dash)
    target = broken["panels"][1]["targets"][0]
    target["expr"] = target["expr"].replace("vllm:time_to_first_token_seconds_bucket",
                                            "vllm:time_to_first_token_bucket")
    assert any("vllm:time_to_first_token_bucket is not" in p for p in problems(broken, names))
    target["expr"] = "sum(rate(vllm:generation_tokens_total[5m]"
    assert any("does not parse" in p for p in problems(broken, names))


def test_it_covers_what_operators_look_at() -> None:
    dash = dashboard()
    used = {n for _, e in expressions(dash)
            for n in metric_names(promql_parser.parse(e.replace("$__rate_interval", "1m")))}
    for name in ("vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:generation_tokens_total",
                 "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                 "tandem_num_preemptions", "tandem_spec_decode_num_accepted_tokens_total",
                 "tandem_process_busy_seconds_total", "tandem_queue_time_seconds_bucket"):
        assert name in used, name
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
