"""The radix tree and the page accounting around it, driven by hypothesis in random orders.

A state machine plays requests against a KVCacheManager exactly as the scheduler
does (match a prefix, allocate, compute, cache, finish or retract) plus direct
evictions, and after every operation checks: free + evictable + protected + in
use == total with no page counted twice, the tree's counters agree with a walk,
every live request's shared prefix is still in the tree under its own tokens,
and a page a live request reads is never handed to anyone else.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache import PageAllocator
from engine.kv_manager import KVCacheManager, pages_needed
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.sampling_params import SamplingParams

# A small alphabet and a few shared stems make prefixes collide often.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [4, 4, 4, 4], []]


def test_match_insert_split_and_evict_by_hand() -> None:
    freed: list[int] = []
    tree = RadixCache(page_size=2, free_pages=freed.extend)
    first = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert first.pages == [10, 11, 12] and tree.evictable_pages == 3
    # A shared first page splits the edge; the second sequence keeps the cached page, adds its own.
    second = tree.insert([1, 2, 7, 8], [20, 21])
    assert second.pages == [10, 21]
    assert tree.match_prefix([1, 2, 3, 4, 9]).pages == [10, 11]  # page-aligned: the odd token is never matched
    assert tree.match_prefix([1, 2, 7]).pages == [10]
    tree.lock(second.node)
    assert (tree.evictable_pages, tree.protected_pages) == (2, 2)
    assert tree.evict(10) == 2 and sorted(freed) == [11, 12]  # only the unlocked branch goes
    tree.unlock(second.node)
    assert tree.evict(10) == 2 and sorted(freed) == [10, 11, 12, 21]
    assert tree.total_pages == 0
    tree.check_counts()


def test_least_recently_used_leaf_goes_first() -> None:
    freed: list[int] = []
    tree = RadixCache(page_size=1, free_pages=freed.extend)
    tree.insert([1, 2], [1, 2])
    tree.insert([3, 4], [3, 4])
    tree.match_prefix([1, 2])  # touch the first: the second is now the older
    tree.evict(1)
    assert freed == [3, 4]


class PagedKVMachine(RuleBasedStateMachine):
    """Requests come and go through a KVCacheManager; the pool must always balance."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Request] = {}
        self.next_id = 0

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 40), seed=st.integers(0, 2**16))
    def setup(self, page_size: int, num_pages: int, seed: int) -> None:
        self.page_size = page_size
        self.manager = KVCacheManager(PageAllocator(num_pages + 1), page_size, enable_prefix_cache=True)
        self.rng = random.Random(seed)

    # ---- operations -------------------------------------------------------------------
    @rule(stem=st.sampled_from(range(len(STEMS))), tail=st.lists(st.integers(1, 6), max_size=10))
    def admit(self, stem: int, tail: list[int]) -> None:
        tokens = STEMS[stem] + tail
        if len(tokens) < 2:
            return
        request = Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=4))
        self.next_id += 1
        cached = self.manager.match_prefix(request)
        assert cached % self.page_size == 0 and cached < len(tokens)
        assert request.shared_pages == self.manager.tree.match_prefix(tokens[: len(tokens) - 1]).pages
        if self.manager.allocate(request, len(tokens) + 1):
            self.live[request.request_id] = request
        else:
            self.manager.undo_match(request)
            assert not request.shared_pages and request.num_cached_tokens == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """A step ran: the request's uncached tokens (or part of them) are now in the pool."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        remaining = request.num_tokens - request.num_cached_tokens
        if remaining > 0:
            request.num_cached_tokens += data.draw(st.integers(1, remaining))
            self.manager.cache_computed(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 6))
    def decode(self, data: st.DataObject, token: int) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_cached_tokens < request.num_tokens:
            return
        if self.manager.allocate(request, request.num_tokens + 1):
            request.output_token_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finished, aborted or retracted: the same release (computed pages stay cached)."""
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.manager.release(request)
        assert not self.manager.allocator.pages_of(request.request_id) and request.cache_node is None

    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages: int) -> None:
        before = self.manager.evictable_pages
        freed = self.manager.tree.evict(num_pages)
        assert freed >= min(num_pages, before) or freed == before

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def pool_balances(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariant()
        read_by_live: list[int] = []
        for request in self.live.values():
            table = self.manager.page_table(request)
            assert len(table) >= pages_needed(request.num_cached_tokens, self.page_size)
            read_by_live.extend(self.manager.allocator.pages_of(request.request_id))
            # The shared prefix is still cached under this request's own tokens (locked, so never evicted).
            shared_tokens = request.all_token_ids[: len(request.shared_pages) * self.page_size]
            assert self.manager.tree.match_prefix(shared_tokens).pages == request.shared_pages
        assert len(read_by_live) == len(set(read_by_live)), "a private page is held by two requests"

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request in list(self.live.values()):
            self.manager.release(request)
        self.manager.check_invariant()
        assert self.manager.protected_pages == 0 and self.manager.pages_in_use == 0
        self.manager.reset_prefix_cache()
        assert self.manager.allocator.num_free == self.manager.total_pages


PagedKVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPagedKV = PagedKVMachine.TestCase
