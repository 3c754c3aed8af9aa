"""Engine counters (queue, KV pool, prefix cache, retractions, step sizes) and their periodic log line."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.scheduler import ScheduledStep

logger = logging.getLogger("engine.stats")

LOG_INTERVAL_S = 10.0


def _decode_batch_bounds() -> tuple[int, ...]:
    """Upper bounds of the decode batch-size histogram: every size to 32, then steps of 2, 4, 8, 16.

    Fine enough that `engine tune-capture` can place capture sizes from a scrape (CUDA's defaults
    step by 8 above 32 and by 16-64 above 96), coarse enough that a scrape stays ~150 lines.
    """
    bounds = list(range(1, 33)) + list(range(34, 65, 2)) + list(range(68, 129, 4)) + list(range(136, 513, 8))
    return tuple(bounds + list(range(528, 1025, 16)))


DECODE_BATCH_BOUNDS = _decode_batch_bounds()
# Tokens of an extend or mixed step (prefill chunks + the decode rows riding along): the shapes that
# extend_capture_tokens buckets would serve.
STEP_TOKEN_BOUNDS = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    24576,
    32768,
)
# Tokens of each prompt: 32-token steps to 1,024 and coarser beyond, fine enough for `engine tune-capture
# --device hpu` to place prompt buckets (its sequence steps are 32 to 256 tokens).
PROMPT_TOKEN_BOUNDS = tuple(
    list(range(32, 1025, 32))
    + list(range(1088, 2049, 64))
    + list(range(2176, 4097, 128))
    + list(range(4352, 8193, 256))
    + [12288, 16384, 24576, 32768, 65536, 131072]
)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative-since-start counts of one step-size histogram (a copy: safe to hand to another thread)."""

    bounds: tuple[int, ...]  # upper bounds, inclusive (Prometheus `le`)
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds: the +Inf bucket
    total: int  # sum of the observed values

    @property
    def count(self) -> int:
        return sum(self.counts)


class SizeHistogram:
    """Counts of one integer per step, in fixed buckets (observe is a bisect and an add: hot path)."""

    def __init__(self, bounds: Sequence[int]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)

    def reset(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0


class StepSizeCounts:
    """Per launched step: a pure decode step's batch size (what the decode graphs serve) or an extend /
    mixed step's token count; per added request, its prompt's tokens (what prompt buckets serve). Read
    back by /metrics and by `engine tune-capture --metrics-url`."""

    def __init__(self) -> None:
        self.decode_batch = SizeHistogram(DECODE_BATCH_BOUNDS)
        self.step_tokens = SizeHistogram(STEP_TOKEN_BOUNDS)
        self.prompt_tokens = SizeHistogram(PROMPT_TOKEN_BOUNDS)

    def record(self, step: ScheduledStep) -> None:
        if step.is_decode:
            self.decode_batch.observe(len(step.requests))
        else:
            self.step_tokens.observe(step.num_decodes + sum(step.extend_lens))

    def record_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.observe(num_tokens)

    def reset(self) -> None:
        self.decode_batch.reset()
        self.step_tokens.reset()
        self.prompt_tokens.reset()


_EMPTY_DECODE = SizeHistogram(DECODE_BATCH_BOUNDS).snapshot()
_EMPTY_TOKENS = SizeHistogram(STEP_TOKEN_BOUNDS).snapshot()
_EMPTY_PROMPTS = SizeHistogram(PROMPT_TOKEN_BOUNDS).snapshot()


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_prefilling: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_in_use: int  # held by live requests (private + locked cached prefixes)
    kv_pages_cached: int  # cached and unreferenced: evictable
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    prefill_computed_tokens: int
    evicted_pages: int
    num_retractions: int
    # Speculative decoding (engine/speculative/acceptance.py), all zero without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # The host-memory tier under the prefix cache (engine/kv_host_tier.py), all zero without it.
    host_pages_total: int = 0
    host_pages_used: int = 0
    host_hits: int = 0
    host_loaded_tokens: int = 0
    host_loaded_bytes: int = 0
    host_written_tokens: int = 0
    host_written_bytes: int = 0
    host_evicted_pages: int = 0
    host_copy_seconds: float = 0.0
    decode_batch_sizes: HistogramSnapshot = field(default=_EMPTY_DECODE)
    extend_step_tokens: HistogramSnapshot = field(default=_EMPTY_TOKENS)
    prompt_tokens: HistogramSnapshot = field(default=_EMPTY_PROMPTS)

    @classmethod
    def collect(cls, engine: Engine) -> EngineStats:
        kv, scheduler = engine.kv_manager, engine.scheduler
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_prefilling=scheduler.num_prefilling,
            kv_pages_total=kv.total_pages,
            kv_pages_free=kv.allocator.num_free,
            kv_pages_in_use=kv.pages_in_use,
            kv_pages_cached=kv.evictable_pages,
            prefix_cache_query_tokens=kv.stats.query_tokens,
            prefix_cache_hit_tokens=kv.stats.hit_tokens,
            prefix_cache_hit_rate=kv.stats.hit_rate,
            prefill_computed_tokens=kv.stats.computed_tokens,
            evicted_pages=kv.evicted_pages,
            num_retractions=scheduler.num_retractions,
            **_speculation(engine),
            **_host_tier(engine),
            decode_batch_sizes=engine.stats_logger.step_sizes.decode_batch.snapshot(),
            extend_step_tokens=engine.stats_logger.step_sizes.step_tokens.snapshot(),
            prompt_tokens=engine.stats_logger.step_sizes.prompt_tokens.snapshot(),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def combine(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """The counters of several engines (data-parallel replicas) as one: sums, and the hit rate of the sums."""
        if not parts:
            raise ValueError("no engine counters to combine")
        summed: dict[str, Any] = {}
        for name, value in asdict(parts[0]).items():
            if isinstance(value, (int, float)):
                summed[name] = sum(getattr(p, name) for p in parts)
        positions = max(len(p.spec_accepted_per_position) for p in parts)
        summed["spec_accepted_per_position"] = tuple(
            sum(p.spec_accepted_per_position[i] for p in parts if i < len(p.spec_accepted_per_position))
            for i in range(positions)
        )
        queries, hits = summed["prefix_cache_query_tokens"], summed["prefix_cache_hit_tokens"]
        summed["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        for name in ("decode_batch_sizes", "extend_step_tokens", "prompt_tokens"):
            histograms = [getattr(p, name) for p in parts]
            summed[name] = HistogramSnapshot(
                histograms[0].bounds,
                tuple(sum(counts) for counts in zip(*(h.counts for h in histograms))),
                sum(h.total for h in histograms),
            )
        return cls(**summed)


def _speculation(engine: Engine) -> dict[str, Any]:
    """The speculative decoding counters of EngineStats (none without a speculator)."""
    if engine.speculator is None:
        return {}
    stats = engine.speculator.stats
    return {
        "spec_num_drafts": stats.num_drafts,
        "spec_num_draft_tokens": stats.num_draft_tokens,
        "spec_num_accepted_tokens": stats.num_accepted_tokens,
        "spec_accepted_per_position": tuple(stats.accepted_per_position),
    }


def _host_tier(engine: Engine) -> dict[str, Any]:
    """The host tier's counters of EngineStats (none without --enable-hierarchical-cache)."""
    tier = engine.kv_manager.host_tier
    if tier is None:
        return {}
    stats = tier.stats
    return {
        "host_pages_total": tier.allocator.total,
        "host_pages_used": tier.allocator.total - tier.allocator.num_free,
        "host_hits": stats.hits,
        "host_loaded_tokens": stats.loaded_tokens,
        "host_loaded_bytes": stats.loaded_bytes,
        "host_written_tokens": stats.written_tokens,
        "host_written_bytes": stats.written_bytes,
        "host_evicted_pages": stats.evicted_pages,
        "host_copy_seconds": stats.copy_seconds,
    }


class StatsLogger:
    """One INFO line every LOG_INTERVAL_S while the engine works (vLLM's periodic stats line)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._last = time.monotonic()
        self.step_sizes = StepSizeCounts()  # fed by Engine._launch, one record per launched step

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last < LOG_INTERVAL_S or not logger.isEnabledFor(logging.INFO):
            return
        self._last = now
        s = EngineStats.collect(self.engine)
        logger.info(
            "running %d, waiting %d | KV pages: %d in use, %d cached, %d free of %d | prefix cache hit rate %.1f%% "
            "(%d of %d prompt tokens), %d pages evicted | %d retractions",
            s.num_running,
            s.num_waiting,
            s.kv_pages_in_use,
            s.kv_pages_cached,
            s.kv_pages_free,
            s.kv_pages_total,
            100 * s.prefix_cache_hit_rate,
            s.prefix_cache_hit_tokens,
            s.prefix_cache_query_tokens,
            s.evicted_pages,
            s.num_retractions,
        )
        if s.host_pages_total:
            logger.info(
                "host KV tier: %d of %d pages used | %d hits, %d tokens loaded back (%.1f MiB), %d written (%.1f MiB), "
                "%d pages dropped | copies %.3f s",
                s.host_pages_used,
                s.host_pages_total,
                s.host_hits,
                s.host_loaded_tokens,
                s.host_loaded_bytes / 2**20,
                s.host_written_tokens,
                s.host_written_bytes / 2**20,
                s.host_evicted_pages,
                s.host_copy_seconds,
            )
        if s.spec_num_drafts:
            # vLLM's "SpecDecoding metrics" line: what the drafts bought since start.
            per_position = ", ".join(f"{n / s.spec_num_drafts:.2f}" for n in s.spec_accepted_per_position)
            logger.info(
                "speculative decoding: mean acceptance length %.2f, acceptance rate %.1f%% (%d of %d draft tokens "
                "in %d drafts), per-position acceptance %s",
                1 + s.spec_num_accepted_tokens / s.spec_num_drafts,
                100 * s.spec_num_accepted_tokens / max(s.spec_num_draft_tokens, 1),
                s.spec_num_accepted_tokens,
                s.spec_num_draft_tokens,
                s.spec_num_drafts,
                per_position,
            )
