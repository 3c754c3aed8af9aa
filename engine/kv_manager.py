"""Which KV pages each request reads and writes: private pages plus a shared cached prefix.

A request's page table is `request.shared_pages` (a prefix held by the radix
cache, locked while the request lives) followed by its private pages (owned
through the PageAllocator). After every extend step, and when a request
finishes or is retracted, its computed full pages move into the radix cache;
pages the cache already held for the same tokens are freed and the request's
table points at the cached ones instead.

Pool invariant: free + evictable + protected + in use == total pages; with the host tier
(engine/hierarchical_cache.py) also host free + host held == host total.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.hierarchical_cache import HierarchicalRadixCache
from engine.kv_cache import PageAllocator
from engine.kv_events import KVEventRecorder
from engine.kv_host_tier import HostKVPool
from engine.radix_cache import RadixCache
from engine.request import Request

logger = logging.getLogger(__name__)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of which served from the cache
    computed_tokens: int = 0  # prefill tokens actually run through the model

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        enable_prefix_cache: bool,
        events: KVEventRecorder | None = None,
        host_tier: HostKVPool | None = None,
        write_through: bool = True,
        evict_ahead: bool | None = None,
    ) -> None:
        """events: where the prefix cache reports the pages it stores and drops (KV cache events), if anywhere;
        host_tier: the host-memory tier under the prefix cache (--enable-hierarchical-cache), if any, written to
        when pages are cached (write_through) or only when they are evicted; evict_ahead: keep a step's worth of
        pages free before each launch (`fence`; default: where the tier copies asynchronously)."""
        self.allocator = allocator
        self.page_size = page_size
        self.host_tier = host_tier if enable_prefix_cache else None
        self.tree: RadixCache | None = None
        if self.host_tier is not None:
            self.tree = HierarchicalRadixCache(page_size, allocator, self.host_tier, write_through, events)
        elif enable_prefix_cache:
            self.tree = RadixCache(page_size, allocator.release, events)
        self.stats = PrefixCacheStats()
        self.evict_ahead = self.host_tier is not None and (
            self.host_tier.copies_asynchronously if evict_ahead is None else evict_ahead
        )
        self._allocated_at_fence = 0
        # Told whenever a request's pages are released (finished, aborted, retracted, or any other
        # caller): the persistent decode row that mirrors its page table is freed with them.
        self.on_release: Callable[[Request], None] = lambda request: None

    # ---- capacity ---------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        return self.allocator.total

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can get: free ones plus cached ones nobody is using."""
        return self.allocator.num_free + (self.tree.evictable_pages if self.tree else 0)

    @property
    def evictable_pages(self) -> int:
        return self.tree.evictable_pages if self.tree else 0

    @property
    def protected_pages(self) -> int:
        return self.tree.protected_pages if self.tree else 0

    @property
    def pages_in_use(self) -> int:
        """Pages live requests hold: their private pages and the cached prefixes they have locked."""
        return self.allocator.num_in_use + self.protected_pages

    @property
    def evicted_pages(self) -> int:
        return self.tree.evicted_pages_total if self.tree else 0

    def page_table(self, request: Request) -> list[int]:
        return request.shared_pages + self.allocator.pages_of(request.request_id)

    # ---- lifecycle --------------------------------------------------------------------
    def match_prefix(self, request: Request) -> int:
        """On admission: reuse the longest cached prefix (leaving at least one token to compute)."""
        assert not request.shared_pages and not self.allocator.pages_of(request.request_id)
        if self.tree is None or request.params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position, so the whole prompt must run.
            return 0
        tokens = request.all_token_ids
        # The request's cache salt is its namespace in the tree: it only ever meets pages of its own salt.
        match = self.tree.match_prefix(tokens[: len(tokens) - 1], request.params.cache_namespace)
        if match.pages:
            self.tree.lock(match.node)
            request.cache_node = match.node
            request.shared_pages = match.pages
        request.num_cached_tokens = len(match.pages) * self.page_size
        return request.num_cached_tokens

    def undo_match(self, request: Request) -> None:
        """The matched request was not admitted after all: it waits again, holding nothing."""
        self.release(request, cache=False)

    def allocate(self, request: Request, num_tokens: int, evict: bool = True) -> bool:
        """Grow the request's table to hold num_tokens tokens, evicting cached pages if needed (and allowed)."""
        need = (
            pages_needed(num_tokens, self.page_size)
            - len(request.shared_pages)
            - len(self.allocator.pages_of(request.request_id))
        )
        if need <= 0:
            return True
        if need > (self.available_pages if evict else self.allocator.num_free):
            return False  # evicting would empty the cache and still not be enough
        short = need - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        if need > self.allocator.num_free:
            return False
        self.allocator.allocate(request.request_id, need)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Shrink the request's table to the pages num_tokens tokens need (a verify step's rejected drafts);
        its decode row re-sends any column that gets a new page later."""
        keep = max(pages_needed(num_tokens, self.page_size) - len(request.shared_pages), 0)
        freed = self.allocator.free_last(request.request_id, len(self.allocator.pages_of(request.request_id)) - keep)
        if freed:
            request.batch_row_pages = min(request.batch_row_pages, len(request.shared_pages) + keep)

    def cache_computed(self, request: Request) -> None:
        """Move the request's computed full pages into the prefix cache (it keeps reading them)."""
        if self.tree is None:
            return
        # An abort can come while a launched step still holds the request's newest token on the device:
        # its k/v may be computed, but the host does not know that token, so it cannot be cached.
        full = min(request.num_cached_tokens, request.num_tokens) // self.page_size
        shared = len(request.shared_pages)
        if full <= shared:
            return
        table = self.page_table(request)
        result = self.tree.insert(
            request.all_token_ids[: full * self.page_size], table[:full], request.params.cache_namespace
        )
        handed_over = self.allocator.disown(request.request_id, full - shared)
        # Another request may have cached the same tokens meanwhile: keep its pages, free ours.
        duplicates = [page for page, kept in zip(handed_over, result.pages[shared:full]) if page != kept]
        if duplicates:
            self.allocator.release(duplicates)
        self.tree.lock(result.node)
        if request.cache_node is not None:
            self.tree.unlock(request.cache_node)
        request.cache_node = result.node
        request.shared_pages = result.pages

    def release(self, request: Request, cache: bool = True) -> None:
        """The request stops holding pages (finished, aborted or retracted); computed pages stay cached."""
        if cache:
            self.cache_computed(request)
        self.allocator.free(request.request_id)
        if request.cache_node is not None:
            assert self.tree is not None
            self.tree.unlock(request.cache_node)
        request.cache_node = None
        request.shared_pages = []
        # Nothing of its KV is held any more; a later release (or a redo) starts from zero.
        request.num_cached_tokens = 0
        self.on_release(request)

    def reset_prefix_cache(self) -> None:
        if self.tree is not None:
            self.tree.reset()

    def fence(self) -> None:
        """Before a step is launched: it runs after the host tier's copies it needs (engine/kv_host_tier.py), and
        it is counted (PageAllocator.steps_launched: which steps may still use a freed page)."""
        if self.evict_ahead:
            self._evict_ahead()
        if self.host_tier is not None:
            self.host_tier.fence(self.allocator.steps_launched)
        self.allocator.steps_launched += 1

    def _evict_ahead(self) -> None:
        """Keep as many pages free as the step about to launch took (at most a quarter of the pool), evicting the
        least recently used prefixes now: their write-backs to the host tier run beside this step, so the next
        step, which takes those pages, finds them copied rather than waiting for the copies (a page handed out
        again waits for a copy still reading it: PageAllocator.on_reuse). Evicting only when a step needs the
        pages put every write-back between two steps. SGLang frees evicted pages once their copy has run."""
        taken = self.allocator.allocated_total - self._allocated_at_fence
        short = min(taken, self.total_pages // 4) - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        self._allocated_at_fence = self.allocator.allocated_total

    # ---- checks -----------------------------------------------------------------------
    def check_invariant(self) -> None:
        """free + evictable + protected + in use == total, with no page counted twice."""
        cached = self.tree.all_pages() if self.tree else []
        if self.tree is not None:
            self.tree.check_counts()
        free, in_use = self.allocator.num_free, self.allocator.num_in_use
        if free + self.evictable_pages + self.protected_pages + in_use != self.total_pages:
            raise AssertionError(
                f"KV pool invariant broken: free {free} + evictable {self.evictable_pages} + protected "
                f"{self.protected_pages} + in use {in_use} != total {self.total_pages}"
            )
        self.allocator.check_invariant(cached)
