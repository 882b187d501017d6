"""deploy/grafana/kvforge.json: a dashboard whose every query parses as PromQL (promql-parser) and names
only series that a running `kvforge serve` exposes on /metrics, with labels they carry."""
import json
import re
from pathlib import Path

import httpx
import pytest

from conftest import API_KEY

promql_parser = pytest.importorskip("promql_parser", reason="the test extra installs it")

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvforge.json"
#: Grafana's interval variables, replaced by a duration so the query parses as plain PromQL
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
#: labels Prometheus adds when it scrapes (target labels), which /metrics itself does not carry
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def parsed(expr: str):
    for variable, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names it is matched or grouped on) for each series selector of ``expr``;
    the grouping labels of an aggregation count for every selector under it."""
    found: list[tuple[str, set[str]]] = []
    groups: list[set[str]] = []

    def pre(node):
        if isinstance(node, promql_parser.AggregateExpr):
            by = node.modifier is not None and node.modifier.type == promql_parser.AggModifierType.By
            groups.append(set(node.modifier.labels) if by else set())
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name for m in node.matchers.matchers if m.name != "__name__"}
            found.append((node.name, labels | {label for group in groups for label in group}))

    def post(node):
        if isinstance(node, promql_parser.AggregateExpr):
            groups.pop()

    promql_parser.walk(parsed(expr), pre, post)
    return found


def exposed(text: str) -> dict[str, set[str]]:
    """Every series name /metrics holds (a counter's ``_total``, a histogram's ``_bucket``, ``_sum``,
    ``_count``, also for a family with no series yet) -> the label names its samples carry."""
    names: dict[str, set[str]] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)", text, flags=re.M):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(kind, [""])
        for suffix in suffixes:
            names.setdefault(re.sub(r"_total$", "", name) + suffix, set())
    for name, labels in re.findall(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\}", text, flags=re.M):
        names.setdefault(name, set()).update(re.findall(r'(\w+)="', labels))
    return names


def test_the_dashboard_charts_what_the_issue_asks_for():
    text = " ".join(expr for _, expr in queries())
    for metric in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "generation_tokens_total", "prompt_tokens_total",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "prefix_cache_queries_total", "num_preemptions_by_mode_total",
                   "spec_decode_num_accepted_tokens_total"):
        assert f"kvforge:{metric}" in text, metric
    assert text.count("histogram_quantile(") >= 9, "p50, p90 and p99 of each latency"


def test_every_query_parses_and_filters_on_the_model_name_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["definition"] == "label_values(kvforge:num_requests_running, model_name)"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
    for title, expr in queries():
        for metric, labels in selectors(expr):
            assert "model_name" in labels, f"{title}: {metric} is not filtered on $model_name"
        assert expr.count("kvforge:") == expr.count('model_name=~"$model_name"'), title


def test_the_query_check_finds_a_broken_query():
    """The parse test can fail: an unbalanced query is refused, and selectors sees the grouping labels."""
    with pytest.raises(Exception, match="paren"):
        parsed("sum(rate(kvforge:prompt_tokens_total[$__rate_interval])")
    assert selectors('sum by (mode) (rate(a_total{model_name="x"}[5m])) / sum(b)') == [
        ("a_total", {"mode", "model_name"}), ("b", set())]


def test_every_series_a_query_names_is_on_metrics_with_the_labels_used(spec_server):
    # spec_server (conftest): speculative decoding on, so its series are on /metrics too (the data-parallel
    # series need Ray: not charted)
    client = httpx.Client(base_url=spec_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    # one request, so the speculative and latency series have samples (and their labels show)
    body = {"model": "dummy:tiny", "prompt": "a b a b a b a b", "max_tokens": 8, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    series = exposed(client.get("/metrics").text)
    missing, unlabelled = [], []
    for title, expr in queries():
        for metric, labels in selectors(expr):
            if metric not in series:
                missing.append(f"{title}: {metric}")
                continue
            extra = labels - series[metric] - TARGET_LABELS - {"le"}
            if extra and series[metric]:  # a family with no series yet shows no labels to compare with
                unlabelled.append(f"{title}: {metric} has no label {sorted(extra)}")
    assert not missing, f"series not on /metrics: {missing}"
    assert not unlabelled, unlabelled
