"""Radix tree from token ids to the KV pages that hold them (SGLang's RadixCache, page-aligned).

Every edge holds a whole number of pages: with page_size > 1 only full pages
are cached, so a match is always page-aligned and a page is never shared by
two different continuations. A node's `lock_ref` counts the running requests
whose prefix passes through it; unlocked nodes are evictable, least recently
used leaves first. The tree owns the pages it holds: eviction hands them back
through `free_pages`.

Tiers (engine/hierarchical_cache.py): a node may also hold a host-memory copy of its
pages (`host_pages`), and a node evicted from the device keeps its key and its host copy
with `pages` empty. This class only ever matches and evicts device pages: its walks stop
at a node without device pages, and its eviction goes through `_evict_leaf`, which the
hierarchical cache overrides to write the pages back instead of dropping them.

Namespaces (vLLM's `cache_salt`): the first page of every cached sequence is keyed
by its namespace as well as its tokens, so sequences of different namespaces start
in different subtrees of the root and never share a page, however equal their
tokens; the same namespace shares as before. None is the namespace of requests
without a salt.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.kv_events import KVEventRecorder, page_hash


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]  # this edge's tokens, a multiple of page_size long
    pages: list[int]  # one page id per page_size tokens of key; empty while only on the host tier
    parent: RadixNode | None
    # By first page of key; below the root by (namespace, first page): RadixCache._child_key.
    children: dict[tuple[object, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    namespace: str | None = None  # the cache salt of every sequence through this node
    hashes: list[int] = field(default_factory=list)  # one per page, while KV events are recorded (kv_events.py)
    # The host tier's copy of the pages, one host page per page (or none): engine/hierarchical_cache.py.
    host_pages: list[int] = field(default_factory=list)
    # Steps launched when the last request let go of the node (lock_ref fell to 0): no step launched since
    # reads its pages (engine/hierarchical_cache.py passes it on when they are evicted).
    released_at: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    pages: list[int]  # pages of the longest cached prefix, in order
    node: RadixNode  # deepest node of the match (lock it to protect the pages)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(
        self, page_size: int, free_pages: Callable[[list[int]], None], events: KVEventRecorder | None = None
    ) -> None:
        """events: where stored and dropped pages are reported (KV cache events for routers), if anywhere."""
        self.page_size = page_size
        self.free_pages = free_pages
        self.events = events
        self.root = RadixNode((), [], None, lock_ref=1)  # the root is never evicted
        self._clock = itertools.count(1)
        self.evictable_pages = 0
        self.protected_pages = 0
        self.evicted_pages_total = 0

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    # ---- lookup -----------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of token_ids in `namespace`; touches it for LRU."""
        node, pages, _ = self._descend(token_ids, len(token_ids) - len(token_ids) % self.page_size, namespace)
        return MatchResult(pages, node)

    def num_pages(self, node: RadixNode) -> int:
        """Pages of the node's key (on the device, the host, or both)."""
        return len(node.key) // self.page_size

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], namespace: str | None = None) -> MatchResult:
        """Cache token_ids (page-aligned) held in `pages` under `namespace`; returns the pages the tree now holds
        for them.

        Where the tree already had a prefix, its pages are kept and the caller's pages for that
        part are not taken (the caller frees any that differ); the rest become the tree's.
        """
        usable = len(pages) * self.page_size
        if len(token_ids) < usable:
            raise ValueError(f"{len(pages)} pages need {usable} tokens, got {len(token_ids)}")
        node, held, offset = self._descend(token_ids, usable, namespace, adopt=pages)
        if offset == usable:
            return MatchResult(held, node)
        first = offset // self.page_size
        leaf = RadixNode(
            tuple(token_ids[offset:usable]),
            list(pages[first:]),
            node,
            last_access=next(self._clock),
            namespace=namespace,
            released_at=self._steps_launched(),  # launched steps wrote these pages
        )
        node.children[self._child_key(node, leaf.key, 0, namespace)] = leaf
        self.evictable_pages += len(leaf.pages)
        if self.events is not None:
            self._record_stored(node, leaf)
        return MatchResult(held + leaf.pages, leaf)

    def _record_stored(self, parent: RadixNode, leaf: RadixNode) -> None:
        previous = parent.hashes[-1] if parent.hashes else None
        first = previous
        for start in range(0, len(leaf.key), self.page_size):
            previous = page_hash(previous, leaf.key[start : start + self.page_size], leaf.namespace)
            leaf.hashes.append(previous)
        assert self.events is not None
        self.events.stored(list(leaf.hashes), first, list(leaf.key), self.page_size)

    # ---- protection -------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = self._parent(node)

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_pages -= len(node.pages)
                self.evictable_pages += len(node.pages)
                node.released_at = self._steps_launched()
            node = self._parent(node)

    def _steps_launched(self) -> int:
        """Steps launched so far, where a subclass tracks them (the host tier's loads need it; here none)."""
        return 0

    @staticmethod
    def _parent(node: RadixNode) -> RadixNode:
        """The parent of a node below the root (only the root has none)."""
        assert node.parent is not None, "radix cache: a node below the root without a parent"
        return node.parent

    # ---- eviction ---------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages (if that many are evictable), least recently used leaves first."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.evictable_pages -= len(leaf.pages)
            freed += len(leaf.pages)
            self._evict_leaf(leaf)
            if parent is not self.root and parent.lock_ref == 0 and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.evicted_pages_total += freed
        return freed

    def _evict_leaf(self, leaf: RadixNode) -> None:
        """Take an unlocked device leaf's pages off the device: here the node leaves the tree (the hierarchical
        cache writes them back to the host tier instead)."""
        self._remove(leaf)
        self.free_pages(leaf.pages)

    def _remove(self, node: RadixNode) -> None:
        """Unlink a node (it has no children) from its parent; routers hear that its pages are gone."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[self._child_key(parent, node.key, 0, node.namespace)]
        if self.events is not None:
            self.events.removed(node.hashes)

    @staticmethod
    def _is_device_leaf(node: RadixNode) -> bool:
        """Holds device pages and no child does (children only on the host tier do not count)."""
        return bool(node.pages) and not any(child.pages for child in node.children.values())

    def reset(self) -> None:
        """Drop every unlocked node (e.g. when the cache is switched off or the weights change)."""
        self.evict(self.evictable_pages)
        if self.events is not None and not self.root.children:
            self.events.cleared()

    # ---- introspection ------------------------------------------------------------------
    def all_pages(self) -> list[int]:
        pages, stack = [], [self.root]
        while stack:
            node = stack.pop()
            pages.extend(node.pages)
            stack.extend(node.children.values())
        return pages

    def check_counts(self) -> None:
        """The incremental evictable/protected counters agree with a walk of the tree."""
        evictable = protected = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref < 0 or any(c.lock_ref > node.lock_ref for c in node.children.values()):
                raise AssertionError("radix cache: a child is locked more than its parent")
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
            stack.extend(node.children.values())
        if (evictable, protected) != (self.evictable_pages, self.protected_pages):
            raise AssertionError(
                f"radix cache counts: walk found evictable {evictable}, protected {protected}; "
                f"counters say {self.evictable_pages}, {self.protected_pages}"
            )

    # ---- internals ----------------------------------------------------------------------
    def _descend(
        self, token_ids: Sequence[int], usable: int, namespace: str | None, adopt: Sequence[int] | None = None
    ) -> tuple[RadixNode, list[int], int]:
        """Follow token_ids[:usable] down `namespace`'s subtree as far as it matches on the device, splitting an
        edge matched part-way.

        Returns the deepest matched node, the pages along the way, and how many tokens matched;
        every node on the path is touched for LRU. A node held only by the host tier ends the walk,
        unless `adopt` (the caller's pages for token_ids, an insert) holds the same tokens on the
        device: the node takes those pages and the walk goes on.
        """
        node, pages, offset = self.root, [], 0
        now = next(self._clock)
        while offset < usable:
            child = node.children.get(self._child_key(node, token_ids, offset, namespace))
            if child is None or (not child.pages and adopt is None):
                break
            matched = self._common_pages(child.key, token_ids, offset, usable)
            if matched < self.num_pages(child):
                child = self._split(child, matched)
            if not child.pages:
                assert adopt is not None and child.lock_ref == 0
                first = offset // self.page_size
                child.pages = list(adopt[first : first + self.num_pages(child)])
                child.released_at = self._steps_launched()  # launched steps wrote these pages
                self.evictable_pages += len(child.pages)
            child.last_access = now
            pages.extend(child.pages)
            offset += len(child.key)
            node = child
        return node, pages, offset

    def _child_key(
        self, parent: RadixNode, token_ids: Sequence[int], offset: int, namespace: str | None
    ) -> tuple[object, ...]:
        """A child's key in parent.children: its first page, and below the root its namespace too (the salt is
        mixed into the first page's key, so different namespaces never meet in one subtree)."""
        page = tuple(token_ids[offset : offset + self.page_size])
        return (namespace, page) if parent is self.root else page

    def _common_pages(self, key: tuple[int, ...], token_ids: Sequence[int], offset: int, limit: int) -> int:
        """Whole pages at the start of key that equal token_ids[offset:limit]."""
        n = min(len(key), limit - offset)
        i = 0
        while i < n and key[i] == token_ids[offset + i]:
            i += 1
        return i // self.page_size

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut node after num_pages pages; returns the new upper part (which keeps node's locks)."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_pages < self.num_pages(node)
        upper = RadixNode(
            node.key[:cut],
            node.pages[:num_pages],
            parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            namespace=node.namespace,
            hashes=node.hashes[:num_pages],
            host_pages=node.host_pages[:num_pages],
            released_at=node.released_at,
        )
        parent.children[self._child_key(parent, node.key, 0, node.namespace)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        node.hashes = node.hashes[num_pages:]
        node.host_pages = node.host_pages[num_pages:]
        upper.children[self._child_key(upper, node.key, 0, node.namespace)] = node
        return upper

    def _evictable_leaves(self) -> list[RadixNode]:
        """Unlocked device leaves. Device pages never hang below a node without them, so the walk stops there."""
        leaves, stack = [], [child for child in self.root.children.values() if child.pages]
        while stack:
            node = stack.pop()
            below = [child for child in node.children.values() if child.pages]
            if below:
                stack.extend(below)
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves
