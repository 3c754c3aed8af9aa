"""Prometheus metrics for /metrics (prometheus_client), with vLLM-like names under `engine:`.

A registry per app (not the global one) so that several apps in one process, as in
tests, do not collide. Gauges read the engine thread's stats snapshot when scraped;
counters and histograms are fed by the engine thread through a StepObserver.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.server.async_engine import LoopStats, StepObserver

# Buckets in seconds: CPU steps are tens of ms, a queued first token can take many seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, stats: LoopStats, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str, read) -> None:  # noqa: ANN001
            Gauge(name, doc, labels, registry=r).labels(model_name).set_function(read)

        gauge("engine:num_requests_running", "Requests in the running batch.", lambda: stats.running)
        gauge("engine:num_requests_waiting", "Requests queued for admission.", lambda: stats.waiting)
        gauge("engine:kv_pages_used", "KV cache pages held by requests.", lambda: stats.kv_pages_used)
        gauge("engine:kv_pages_total", "KV cache pages in the pool.", lambda: stats.kv_pages_total)
        gauge(
            "engine:kv_cache_usage_perc", "Fraction of KV pages in use (0 to 1).",
            lambda: stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0,
        )
        self.prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens admitted.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(
            "engine:generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model_name)
        self._finished = Counter("engine:request_success", "Finished requests by reason.", labels + ["finished_reason"], registry=r)
        self.ttft = Histogram(
            "engine:time_to_first_token_seconds", "Time from arrival to first token.", labels, buckets=TTFT_BUCKETS, registry=r
        ).labels(model_name)
        self.itl = Histogram(
            "engine:inter_token_latency_seconds", "Time between consecutive tokens of a request.", labels,
            buckets=ITL_BUCKETS, registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "engine:e2e_request_latency_seconds", "Time from arrival to the last token.", labels, buckets=E2E_BUCKETS, registry=r
        ).labels(model_name)
        self.model_name = model_name
        r.register(_CacheCollector(stats, model_name))

    def observer(self) -> StepObserver:
        return StepObserver(
            on_first_token=self.ttft.observe,
            on_inter_token=self.itl.observe,
            on_tokens=self.generation_tokens.inc,
            on_prompt_tokens=self.prompt_tokens.inc,
            on_finished=self._on_finished,
        )

    def _on_finished(self, reason: str, seconds: float | None) -> None:
        self._finished.labels(self.model_name, reason).inc()
        if seconds is not None:
            self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector:
    """Prefix-cache and memory-pressure counters, read from the engine's own totals when scraped."""

    def __init__(self, stats: LoopStats, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the engine's snapshot may not exist yet at registration

    def collect(self) -> Iterator[Metric]:
        core = self.stats.engine
        if core is None:
            return
        counters = [
            ("engine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", core.prefix_cache_query_tokens),
            ("engine:prefix_cache_hits", "Prompt tokens served from the prefix cache.", core.prefix_cache_hit_tokens),
            ("engine:prefill_computed_tokens", "Prompt tokens run through the model (redone work included).",
             core.prefill_computed_tokens),
            ("engine:kv_pages_evicted", "Cached KV pages evicted to make room.", core.evicted_pages),
            ("engine:num_preemptions", "Requests retracted under KV memory pressure.", core.num_retractions),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        gauges = [
            ("engine:prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache, since the server started.", core.prefix_cache_hit_rate),
            ("engine:kv_pages_cached", "KV pages held only by the prefix cache (evictable).", core.kv_pages_cached),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
