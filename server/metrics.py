"""Prometheus metrics for ``GET /metrics``: engine gauges and counters read at scrape time,
latency histograms observed as outputs stream out.

Every series carries ``model_name``: the first served name of its engine. With several models the
exposition still holds each family once (one HELP and TYPE line), with one series per model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvforge.engine.stats import EngineStats
    from kvforge.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Each engine's gauges and counters, read at scrape time, merged into one family per metric."""

    def __init__(self) -> None:
        self.stats: dict[str, Callable[[], EngineStats]] = {}  # model_name -> its engine's get_stats

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, stats in list(self.stats.items()):
            for family in _engine_families(stats(), model):
                if family.name in families:  # NOTE: same name, same type and help: only the series add up
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


def _engine_families(s: EngineStats, model: str) -> Iterator[Metric]:
    """One engine's families (its ``get_stats()`` as ``s``), each series labelled ``model_name=model``."""
    labels = ["model_name"]

    def gauge(name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric([model], value)
        return g

    def counter(name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric([model], value)
        return c

    def by(family: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, label: str,
           values: Iterable[tuple[object, float]]) -> Metric:
        """One series per (label value, value) pair of ``values``."""
        f = family(name, doc, labels=[*labels, label])
        for key, value in values:
            f.add_metric([model, str(key)], value)
        return f

    yield gauge("kvforge:num_requests_running", "Sequences in the running batch.", s["num_running"])
    yield gauge("kvforge:num_requests_waiting", "Sequences waiting to be scheduled.", s["num_waiting"])
    yield gauge("kvforge:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s["kv_cache_usage"])
    yield counter("kvforge:prefix_cache_queries", "Tokens looked up in the prefix cache.", s["prefix_cache_queries"])
    yield counter("kvforge:prefix_cache_hits", "Tokens found in the prefix cache.", s["prefix_cache_hits"])
    yield counter("kvforge:prefix_cache_tier_hits", "Tokens of the prefix-cache hits that came from the tiers beyond "
                  "the GPU.", s["prefix_cache_tier_hits"])
    yield by(CounterMetricFamily, "kvforge:prefix_cache_tier_hits_by_tier", "The same, by tier.", "tier",
             (("cpu", s["prefix_cache_cpu_hits"]), ("disk", s["prefix_cache_disk_hits"])))
    yield counter("kvforge:kv_tier_stored_blocks", "Prefix-cached KV blocks saved to the tiers beyond the GPU.",
                  s["kv_tier_stored_blocks"])
    yield by(GaugeMetricFamily, "kvforge:kv_tier_blocks", "Prefix-cached KV blocks each tier beyond the GPU holds.",
             "tier", (("cpu", s["kv_tier_cpu_blocks"]), ("disk", s["kv_tier_disk_blocks"])))
    yield counter("kvforge:num_preemptions", "Preemptions of running sequences.", s["num_preemptions"])
    yield by(CounterMetricFamily, "kvforge:num_preemptions_by_mode", "Preemptions by mode.", "mode",
             (("recompute", s["num_preemptions_recompute"]), ("swap", s["num_preemptions_swap"])))
    yield counter("kvforge:swapped_out_blocks", "KV blocks copied to the CPU swap pool.",
                  s["num_swapped_out_blocks"])
    yield gauge("kvforge:num_requests_swapped", "Sequences whose KV blocks wait in the CPU swap pool.",
                s["num_swapped"])
    yield by(GaugeMetricFamily, "kvforge:num_requests_waiting_by_priority",
             "Sequences waiting to be scheduled, by request priority.", "priority", s["waiting_by_priority"].items())
    yield by(GaugeMetricFamily, "kvforge:rank_batch_requests",
             "Requests a rank holds block tables for, as of the engine's last idle moment.", "rank",
             enumerate(s["rank_batch_requests"]))
    if "data_parallel_routed" in s:  # --data-parallel-size > 1
        yield by(CounterMetricFamily, "kvforge:data_parallel_requests", "Requests sent to each engine replica.",
                 "replica", enumerate(s["data_parallel_routed"]))
    yield counter("kvforge:prompt_tokens", "Prompt tokens processed.", s["num_prompt_tokens"])
    yield counter("kvforge:generation_tokens", "Tokens generated.", s["num_generation_tokens"])
    spec = s.get("spec_decode")
    if spec is not None:  # speculative decoding is on
        yield counter("kvforge:spec_decode_num_drafts", "Request-steps that verified drafts.", spec["num_drafts"])
        yield counter("kvforge:spec_decode_num_draft_tokens", "Draft tokens verified.", spec["num_draft_tokens"])
        yield counter("kvforge:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      spec["num_accepted_tokens"])
        yield by(CounterMetricFamily, "kvforge:spec_decode_num_accepted_tokens_per_pos",
                 "Draft tokens accepted, by position in the draft.", "position",
                 enumerate(spec["accepted_by_position"]))
        yield gauge("kvforge:spec_decode_acceptance_rate", "Accepted / verified draft tokens since start.",
                    spec["acceptance_rate"])
        yield gauge("kvforge:spec_decode_mean_accepted_length",
                    "Tokens per request-step that verified drafts (1 + accepted drafts), since start.",
                    spec["mean_accepted_length"])


class _IgnoredFieldsCollector:
    """``kvforge:ignored_request_fields_total{field}``: requests that carried each field outside the API
    (``server/request_fields.py``), read at scrape time; no ``model_name``: a field is the server's."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvforge:ignored_request_fields",
                                     "Requests that carried a field outside the API, ignored.", labels=["field"])
        for field, count in list(self.counts.items()):
            family.add_metric([field], count)
        yield family


class ModelMetrics:
    """One model's request-latency histograms (its ``model_name`` series of the server's)."""

    def __init__(self, model: str, ttft: Histogram, itl: Histogram, e2e: Histogram):
        self.model, self.ttft, self.itl, self.e2e = model, ttft, itl, e2e

    def observe(self, out: RequestOutput, previous_token_time: float | None) -> float | None:
        """Record one output delta's latencies; returns the new last-token time."""
        m = out.metrics
        if m is None or m.last_token_time is None:
            return previous_token_time
        if previous_token_time is None:
            if m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        elif m.last_token_time > previous_token_time:
            self.itl.observe(m.last_token_time - previous_token_time)
        if out.finished and m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        return m.last_token_time


class ServerMetrics:
    """The server's registry: every model's engine metrics and latency histograms.

    ``ServerMetrics(stats, model)`` is ``ServerMetrics()`` followed by ``add_model(stats, model)``.
    ``ignored_fields``: field -> count of requests that carried it outside the API (``FieldPolicy.ignored``).
    """

    def __init__(self, stats: Callable[[], EngineStats] | None = None, model: str | None = None, *,
                 ignored_fields: dict[str, int] | None = None):
        self.registry = CollectorRegistry()
        self._engines = _EngineCollector()
        self.registry.register(self._engines)
        self.registry.register(_IgnoredFieldsCollector({} if ignored_fields is None else ignored_fields))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labelnames=["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS)

        self._ttft = histogram("kvforge:time_to_first_token_seconds", "Time to first token.")
        self._itl = histogram("kvforge:inter_token_latency_seconds", "Time between output deltas.")
        self._e2e = histogram("kvforge:e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.models: dict[str, ModelMetrics] = {}
        if stats is not None:
            if model is None:
                raise TypeError("ServerMetrics(stats, model): the model name of the stats is missing")
            self.add_model(stats, model)

    def add_model(self, stats: Callable[[], EngineStats], model: str) -> ModelMetrics:
        """Expose an engine's stats (``get_stats``, called at each scrape) as ``model_name=model``;
        returns that model's histograms, for its ``OpenAIServing`` to observe."""
        if model in self.models:
            raise ValueError(f"model_name: {model!r} already has metrics")
        self._engines.stats[model] = stats
        self.models[model] = ModelMetrics(model, self._ttft.labels(model), self._itl.labels(model),
                                          self._e2e.labels(model))
        return self.models[model]

    def render(self) -> bytes:
        return generate_latest(self.registry)
