"""Where `engine tune-capture` gets its batch-size distribution: a file, a spec, a server's /metrics, or a default.

Every source ends as a SizeDistribution: probability per decode batch size (integers >= 1). A
Prometheus histogram only knows how many steps fell in each bucket, so its counts are spread
evenly over the integers of the bucket: exact up to 32 (one bucket per size, engine/stats.py),
within 2-16 rows above.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DECODE_HISTOGRAM = "engine:decode_batch_size"
TOKENS_HISTOGRAM = "engine:extend_step_tokens"


@dataclass(frozen=True)
class SizeDistribution:
    """Probability of each decode batch size, and where it came from."""

    weights: dict[int, float]  # size -> probability; sums to 1
    source: str
    observations: float = 0.0  # steps counted (0: not observed, e.g. the default)

    @classmethod
    def from_counts(cls, counts: Mapping[int, float], source: str) -> SizeDistribution:
        clean: dict[int, float] = {}
        for size, count in counts.items():
            size, count = int(size), float(count)
            if size < 1:
                raise ValueError(f"{source}: batch sizes must be >= 1, got {size}")
            if count < 0 or math.isnan(count):
                raise ValueError(f"{source}: counts must be non-negative, got {count} for size {size}")
            if count > 0:
                clean[size] = clean.get(size, 0.0) + count
        total = sum(clean.values())
        if total <= 0:
            raise ValueError(f"{source}: no decode steps counted (every count is zero)")
        return cls({s: c / total for s, c in sorted(clean.items())}, source, total)

    @property
    def max_size(self) -> int:
        return max(self.weights)

    @property
    def mean(self) -> float:
        return sum(s * p for s, p in self.weights.items())

    def mass_above(self, size: int) -> float:
        return sum(p for s, p in self.weights.items() if s > size)

    def clipped(self, max_size: int) -> SizeDistribution:
        """Sizes above max_size folded onto it (the scheduler never batches more than max_num_seqs)."""
        if self.max_size <= max_size:
            return self
        folded: dict[int, float] = {}
        for size, p in self.weights.items():
            folded[min(size, max_size)] = folded.get(min(size, max_size), 0.0) + p
        return SizeDistribution(
            folded, f"{self.source} (sizes above {max_size} counted at {max_size})", self.observations
        )

    def summary(self, noun: str = "batch") -> str:
        """noun: what a size counts ("batch" for decode rows, "tokens" for extend steps)."""
        top = sorted(self.weights.items(), key=lambda kv: -kv[1])[:3]
        modes = ", ".join(f"{s} ({100 * p:.0f}%)" for s, p in top)
        counted = f"{self.observations:.0f} steps, " if self.observations else ""
        return f"{self.source}: {counted}mean {noun} {self.mean:.1f}, max {self.max_size}, most frequent {modes}"


def default_distribution(max_size: int) -> SizeDistribution:
    """The default when no traffic is known: log-uniform, p(b) proportional to 1/b, so every doubling of the
    batch is equally likely. A uniform prior would put 99% of the mass above batch 8 at max_num_seqs 512,
    and the tuner would then drop the small sizes that a lightly loaded server runs all day."""
    total = sum(1.0 / s for s in range(1, max_size + 1))
    return SizeDistribution(
        {s: 1.0 / s / total for s in range(1, max_size + 1)}, f"default: log-uniform over 1..{max_size} (p(b) ~ 1/b)"
    )


def parse_spec(spec: str) -> SizeDistribution:
    """'1-8:0.1,33-40:0.6,70:0.3': weight per size or range (a range's weight spread evenly over it)."""
    counts: dict[int, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        where, _, weight = part.partition(":")
        low, _, high = where.partition("-")
        try:
            lo, hi, w = int(low), int(high or low), float(weight or 1.0)
        except ValueError as exc:
            raise ValueError(f"distribution spec {spec!r}: expected SIZE[-SIZE][:WEIGHT] items, got {part!r}") from exc
        if hi < lo:
            raise ValueError(f"distribution spec {spec!r}: empty range {part!r}")
        for size in range(lo, hi + 1):
            counts[size] = counts.get(size, 0.0) + w / (hi - lo + 1)
    weights = SizeDistribution.from_counts(counts, f"spec {spec}").weights
    return SizeDistribution(weights, f"spec {spec}")  # weights, not observed steps


def _counts_from_json(data: Any, source: str) -> dict[int, float]:
    """{"33": 120, ...}, [[33, 120], ...], [33, 33, 40, ...] (observed sizes), or any of those under a
    "decode_batch_size" / "distribution" key (the tuner's own JSON report has it there)."""
    if isinstance(data, dict):
        for key in ("decode_batch_size", "distribution"):
            if key in data:
                return _counts_from_json(data[key], source)
        return {int(k): float(v) for k, v in data.items()}
    if isinstance(data, list) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in data):
        return _accumulate((int(s), float(c)) for s, c in data)
    if isinstance(data, list) and all(isinstance(x, (int, float)) for x in data):
        return _accumulate((int(s), 1.0) for s in data)
    raise ValueError(f"{source}: expected a size -> count mapping, [size, count] pairs or a list of sizes")


def _counts_from_csv(text: str, source: str) -> dict[int, float]:
    """Rows of `size,count` (or one column of observed sizes); a header row is skipped."""
    pairs: list[tuple[int, float]] = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row if c.strip()]
        if not cells or cells[0].startswith("#"):
            continue
        try:
            pairs.append((int(float(cells[0])), float(cells[1]) if len(cells) > 1 else 1.0))
        except ValueError:
            if pairs:  # only the first row may be a header
                raise ValueError(f"{source}: bad row {row!r}") from None
    return _accumulate(pairs)


def _accumulate(pairs: Iterable[tuple[int, float]]) -> dict[int, float]:
    counts: dict[int, float] = {}
    for size, count in pairs:
        counts[size] = counts.get(size, 0.0) + count
    return counts


def load_distribution_file(path: str, histogram: str = DECODE_HISTOGRAM) -> SizeDistribution:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if path.endswith(".prom") or histogram + "_bucket" in text:
        return from_prometheus_text(text, source=path, name=histogram)
    if path.endswith(".json"):
        counts = _counts_from_json(json.loads(text), path)
    else:
        counts = _counts_from_csv(text, path)
    return SizeDistribution.from_counts(counts, path)


def histogram_counts(text: str, name: str = DECODE_HISTOGRAM) -> tuple[dict[float, float], float]:
    """Per-bucket (not cumulative) counts of a Prometheus histogram, keyed by upper bound (inf for +Inf),
    summed over label sets (one server may serve several model names); and the observations' sum."""
    from prometheus_client.parser import text_string_to_metric_families

    cumulative: dict[tuple[tuple[str, str], ...], dict[float, float]] = {}
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        found = True
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            key = tuple(sorted(labels.items()))
            if sample.name == name + "_bucket":
                cumulative.setdefault(key, {})[float(sample.labels["le"])] = float(sample.value)
            elif sample.name == name + "_sum":
                total += float(sample.value)
    if not found:
        raise ValueError(f"no histogram {name!r} in the metrics text (a server of this engine exports it)")
    per_bucket: dict[float, float] = {}
    for buckets in cumulative.values():
        previous = 0.0
        for bound in sorted(buckets):
            per_bucket[bound] = per_bucket.get(bound, 0.0) + buckets[bound] - previous
            previous = buckets[bound]
    return per_bucket, total


def from_prometheus_text(text: str, source: str = "metrics", name: str = DECODE_HISTOGRAM) -> SizeDistribution:
    """A decode batch-size distribution from the /metrics histogram: each bucket's count spread evenly over
    the integers in (previous bound, bound]; the +Inf bucket's steps placed by the sum's leftover mean."""
    per_bucket, total = histogram_counts(text, name)
    counts: dict[int, float] = {}
    previous = 0
    finite_sum = 0.0
    for bound in sorted(b for b in per_bucket if math.isfinite(b)):
        count, top = per_bucket[bound], int(bound)
        if count > 0 and top > previous:
            share = count / (top - previous)
            for size in range(previous + 1, top + 1):
                counts[size] = counts.get(size, 0.0) + share
                finite_sum += share * size
        previous = max(previous, top)
    overflow = per_bucket.get(math.inf, 0.0)
    if overflow > 0:
        # Beyond the last bound only the sum says where they were: put them at their mean.
        mean = max(previous + 1, round((total - finite_sum) / overflow))
        counts[mean] = counts.get(mean, 0.0) + overflow
    return SizeDistribution.from_counts(counts, source)


def fetch_metrics(url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """GET the server's /metrics text (URL with or without the /metrics path)."""
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    request = urllib.request.Request(url)
    key = api_key or os.environ.get("ENGINE_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode("utf-8")


def load_distribution(
    distribution: str | None,
    metrics_url: str | None,
    max_size: int,
    api_key: str | None = None,
    histogram: str = DECODE_HISTOGRAM,
) -> SizeDistribution:
    """The tuner's distribution: --distribution (a file, or a spec like '33-40:0.6,70:0.4'), --metrics-url,
    or the log-uniform default over 1..max_size; always folded to at most max_size. `histogram`: the /metrics
    histogram read (decode batch sizes, or TOKENS_HISTOGRAM: tokens per extend or mixed step)."""
    if distribution and metrics_url:
        raise ValueError("give --distribution or --metrics-url, not both")
    if metrics_url:
        found = from_prometheus_text(fetch_metrics(metrics_url, api_key), source=metrics_url, name=histogram)
    elif distribution and os.path.exists(distribution):
        found = load_distribution_file(distribution, histogram)
    elif distribution:
        found = parse_spec(distribution)
    else:
        found = default_distribution(max_size)
    return found.clipped(max_size)
