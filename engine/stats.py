"""Engine counters (queue, KV pool, prefix cache, retractions) and their periodic log line."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger("engine.stats")

LOG_INTERVAL_S = 10.0


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

    @classmethod
    def collect(cls, engine: "Engine") -> "EngineStats":
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
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsLogger:
    """One INFO line every LOG_INTERVAL_S while the engine works (vLLM's periodic stats line)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._last = time.monotonic()

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last < LOG_INTERVAL_S or not logger.isEnabledFor(logging.INFO):
            return
        self._last = now
        s = EngineStats.collect(self.engine)
        logger.info(
            "running %d, waiting %d | KV pages: %d in use, %d cached, %d free of %d | prefix cache hit rate %.1f%% "
            "(%d of %d prompt tokens), %d pages evicted | %d retractions",
            s.num_running, s.num_waiting, s.kv_pages_in_use, s.kv_pages_cached, s.kv_pages_free, s.kv_pages_total,
            100 * s.prefix_cache_hit_rate, s.prefix_cache_hit_tokens, s.prefix_cache_query_tokens, s.evicted_pages,
            s.num_retractions,
        )
