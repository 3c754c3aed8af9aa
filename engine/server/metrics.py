"""Prometheus metrics for /metrics (prometheus_client), with vLLM-like names under `engine:`.

A registry per app (not the global one) so that several apps in one process, as in
tests, do not collide. Queue, KV and prefix-cache series and the step-size histograms are
read from the engine's latest stats snapshot when scraped; token counters and latency
histograms are fed by the engine thread through a StepObserver.

The step-size histograms (engine:decode_batch_size: rows of each pure decode step, the
shapes the decode graphs serve; engine:extend_step_tokens: tokens of each extend or mixed
step; engine:request_prompt_tokens: each added request's prompt, what HPU prompt buckets serve) are
counted in the engine (engine/stats.py), so that they cross the engine process's pipe inside
its snapshot; `engine tune-capture --metrics-url` reads them back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from engine.server.api_servers import MULTIPROCESS_DIR_ENV
from engine.server.async_engine import StepObserver
from engine.stats import EngineStats, HistogramSnapshot
from engine.structured.pool import PoolCounts

# Buckets in seconds: CPU steps are tens of ms, a queued first token can take many seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats], model_name: str) -> None:
        """snapshot: the engine's latest EngineStats (AsyncEngine rewrites it after every step)."""
        self.registry = CollectorRegistry()  # what /metrics renders
        labels = ["model_name"]
        exposed = self.registry
        exposed.register(_EngineStatsCollector(snapshot, model_name))
        # The grammar checks' counts (engine/structured/pool.py); build_app points this at its checker.
        self.grammar_counts: Callable[[], PoolCounts] = PoolCounts
        exposed.register(_GrammarCollector(lambda: self.grammar_counts(), model_name))
        # Engine requests the server holds (build_app points this at Serving.pending): the engine's own gauges
        # miss those still tokenized, checked or on their way to the engine.
        self.pending: Callable[[], int] = lambda: 0
        exposed.register(_PendingCollector(lambda: self.pending(), model_name))
        # Data-parallel replicas (build_app points this at the ReplicaSet): per replica, up, requests, restarts.
        self.replicas: Callable[[], ReplicaCounts | None] = lambda: None
        exposed.register(_ReplicaCollector(lambda: self.replicas(), model_name))
        r = exposed
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            # Several API-server processes (engine/server/api_servers.py): the counters and histograms each
            # process feeds live in prometheus_client's shared files, and every process renders their sum.
            MultiProcessCollector(exposed)
            r = CollectorRegistry()  # this process's own copies: written through to the files, never rendered
        self.prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens admitted.", labels, registry=r).labels(
            model_name
        )
        self.generation_tokens = Counter("engine:generation_tokens", "Tokens generated.", labels, registry=r).labels(
            model_name
        )
        self._finished = Counter(
            "engine:request_success", "Finished requests by reason.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "engine:time_to_first_token_seconds",
            "Time from arrival to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "engine:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "engine:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.model_name = model_name

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


def _engine_series(s: EngineStats) -> list[tuple[str, str, str, float]]:
    """(kind, name, help, value) of every series read from the engine's own counters."""
    return [
        (
            "gauge",
            "engine:num_requests_running",
            "Requests in the running batch (a chunked prefill included).",
            s.num_running + s.num_prefilling,
        ),
        ("gauge", "engine:num_requests_waiting", "Requests queued for admission.", s.num_waiting),
        ("gauge", "engine:kv_pages_used", "KV cache pages held by requests.", s.kv_pages_in_use),
        ("gauge", "engine:kv_pages_total", "KV cache pages in the pool.", s.kv_pages_total),
        (
            "gauge",
            "engine:kv_cache_usage_perc",
            "Fraction of KV pages in use (0 to 1).",
            s.kv_pages_in_use / s.kv_pages_total if s.kv_pages_total else 0.0,
        ),
        ("gauge", "engine:kv_pages_cached", "KV pages held only by the prefix cache (evictable).", s.kv_pages_cached),
        (
            "gauge",
            "engine:prefix_cache_hit_rate",
            "Fraction of prompt tokens served from the prefix cache, since start.",
            s.prefix_cache_hit_rate,
        ),
        (
            "counter",
            "engine:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_query_tokens,
        ),
        (
            "counter",
            "engine:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            s.prefix_cache_hit_tokens,
        ),
        (
            "counter",
            "engine:prefill_computed_tokens",
            "Prompt tokens run through the model (redone work included).",
            s.prefill_computed_tokens,
        ),
        ("counter", "engine:kv_pages_evicted", "Cached KV pages evicted to make room.", s.evicted_pages),
        ("counter", "engine:num_preemptions", "Requests retracted under KV memory pressure.", s.num_retractions),
        *_host_tier_series(s),
    ]


def _host_tier_series(s: EngineStats) -> list[tuple[str, str, str, float]]:
    """The host KV tier's series (--enable-hierarchical-cache; docs/kv_host_tier.md), none without it."""
    if not s.host_pages_total:
        return []
    return [
        ("gauge", "engine:hicache_host_pages_total", "KV pages of the host-memory tier.", s.host_pages_total),
        ("gauge", "engine:hicache_host_pages_used", "Host-tier KV pages holding cached prefixes.", s.host_pages_used),
        (
            "counter",
            "engine:hicache_host_hits",
            "Prefix matches that loaded pages back from the host tier.",
            s.host_hits,
        ),
        (
            "counter",
            "engine:hicache_loaded_tokens",
            "Tokens of KV loaded back from the host tier instead of recomputed.",
            s.host_loaded_tokens,
        ),
        (
            "counter",
            "engine:hicache_loaded_bytes",
            "Bytes copied from the host tier to the device.",
            s.host_loaded_bytes,
        ),
        ("counter", "engine:hicache_written_tokens", "Tokens of KV written to the host tier.", s.host_written_tokens),
        (
            "counter",
            "engine:hicache_written_bytes",
            "Bytes copied from the device to the host tier.",
            s.host_written_bytes,
        ),
        (
            "counter",
            "engine:hicache_evicted_pages",
            "Host-tier pages dropped (for room, or evicted from the device before their copy ran).",
            s.host_evicted_pages,
        ),
        ("counter", "engine:hicache_copy_seconds", "Time the host-tier copies took.", s.host_copy_seconds),
    ]


def _step_histograms(s: EngineStats) -> list[tuple[str, str, HistogramSnapshot]]:
    """(name, help, counts) of the per-step size histograms."""
    return [
        (
            "engine:decode_batch_size",
            "Rows of each decode step (the batch a decode graph serves, before padding).",
            s.decode_batch_sizes,
        ),
        (
            "engine:extend_step_tokens",
            "Tokens of each extend or mixed step (prefill chunks and decode rows riding along).",
            s.extend_step_tokens,
        ),
        (
            "engine:request_prompt_tokens",
            "Prompt tokens of each request added (what HPU prompt buckets serve).",
            s.prompt_tokens,
        ),
    ]


def _histogram_family(name: str, doc: str, histogram: HistogramSnapshot, model_name: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip(histogram.bounds, histogram.counts):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    buckets.append(("+Inf", histogram.count))
    family.add_metric([model_name], buckets, sum_value=histogram.total)
    return family


def _vllm_series(s: EngineStats) -> list[tuple[str, str, str, float]]:
    """The same counters under the vLLM names that routers read (llm-d's endpoint picker, NVIDIA Dynamo, the
    Gateway API inference extension): waiting and running requests and KV-cache use; the older
    `vllm:gpu_cache_usage_perc` for pickers that predate the rename."""
    usage = s.kv_pages_in_use / s.kv_pages_total if s.kv_pages_total else 0.0
    queries, hits = s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens
    return [
        ("gauge", "vllm:num_requests_running", "Requests in the running batch.", s.num_running + s.num_prefilling),
        ("gauge", "vllm:num_requests_waiting", "Requests queued for admission.", s.num_waiting),
        ("gauge", "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", usage),
        ("gauge", "vllm:gpu_cache_usage_perc", "KV-cache usage: 1 means 100 percent (the older name).", usage),
        ("counter", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
        ("counter", "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", hits),
        # Speculative decoding, as vLLM counts it: acceptance length = 1 + accepted tokens / drafts.
        ("counter", "vllm:spec_decode_num_drafts", "Verify-step drafts (one per request and step).", s.spec_num_drafts),
        ("counter", "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens),
        ("counter", "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens),
    ]


T = TypeVar("T")


class _ReadAtScrape(Generic[T]):
    """A collector whose series are read from `source()` at each scrape (what is current then), for one model."""

    def __init__(self, source: Callable[[], T], model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # nothing to declare up front: the series exist when read


class _EngineStatsCollector(_ReadAtScrape[EngineStats]):
    """Queue, KV pool and prefix-cache series, read from one engine snapshot per scrape."""

    def collect(self) -> Iterator[Metric]:
        snapshot = self.source()
        for kind, name, doc, value in _engine_series(snapshot) + _vllm_series(snapshot):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, histogram in _step_histograms(snapshot):
            yield _histogram_family(name, doc, histogram, self.model_name)
        if snapshot.spec_accepted_per_position:
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position.",
                labels=["model_name", "position"],
            )
            for position, count in enumerate(snapshot.spec_accepted_per_position):
                family.add_metric([self.model_name, str(position)], count)
            yield family


@dataclass
class ReplicaCounts:
    """Data-parallel replicas as /metrics shows them (engine/server/replicas.py)."""

    names: list[str]
    up: list[bool]
    requests: list[int]  # requests each holds
    restarts: list[int]
    decisions: dict[str, int]  # the router's choices by reason (cache, balance, capacity, ...)


class _ReplicaCollector(_ReadAtScrape[ReplicaCounts | None]):
    def collect(self) -> Iterator[Metric]:
        c = self.source()
        if c is None:
            return
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily("engine:replica_up", "1 while the replica serves, 0 while it is down.", labels=labels)
        held = GaugeMetricFamily("engine:replica_requests", "Requests the replica holds.", labels=labels)
        restarts = CounterMetricFamily("engine:replica_restarts", "Times the replica was started again.", labels=labels)
        for name, is_up, requests, restarted in zip(c.names, c.up, c.requests, c.restarts):
            up.add_metric([self.model_name, name], float(is_up))
            held.add_metric([self.model_name, name], requests)
            restarts.add_metric([self.model_name, name], restarted)
        decisions = CounterMetricFamily(
            "engine:router_decisions",
            "Requests routed, by why their replica was chosen: cache (the longest cached prefix), balance (the "
            "idlest, load out of balance), capacity (the smallest prefix tree), round_robin, shortest_queue.",
            labels=["model_name", "reason"],
        )
        for reason, count in c.decisions.items():
            decisions.add_metric([self.model_name, reason], count)
        yield from (up, held, restarts, decisions)


class _PendingCollector(_ReadAtScrape[int]):
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "engine:num_requests_pending",
            "Engine requests (prompts x n) the server has admitted and not finished: those still waiting for their "
            "grammar's check or on their way to the engine, queued and running.",
            labels=["model_name"],
        )
        family.add_metric([self.model_name], self.source())
        yield family


class _GrammarCollector(_ReadAtScrape[PoolCounts]):
    """The compiler processes' queue and what they refused or dropped (engine/structured/pool.py)."""

    def collect(self) -> Iterator[Metric]:
        c = self.source()
        series = [
            (GaugeMetricFamily, "engine:grammar_checks_queued", "Request grammars waiting for a compiler.", c.queued),
            (GaugeMetricFamily, "engine:grammar_checks_running", "Request grammars being compiled.", c.running),
            (
                CounterMetricFamily,
                "engine:grammar_checks_timed_out",
                "Request grammars refused at the compile deadline (their process killed).",
                c.timed_out,
            ),
            (
                CounterMetricFamily,
                "engine:grammar_checks_cancelled",
                "Request grammar checks dropped or killed because every client waiting for them left.",
                c.cancelled,
            ),
            (
                CounterMetricFamily,
                "engine:grammar_checks_crashed",
                "Request grammars whose compiler process died on them.",
                c.crashed,
            ),
            (
                CounterMetricFamily,
                "engine:grammar_checks_demoted",
                "Request grammar checks that passed 0.5 s of CPU and went on at the lowest priority.",
                c.demoted,
            ),
        ]
        for family_type, name, doc, value in series:
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
