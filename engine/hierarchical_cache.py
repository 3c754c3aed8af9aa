"""The radix cache over two tiers, device pool and host memory (SGLang's HiRadixCache).

A node's pages may live on the device (`pages`), on the host tier (`host_pages`), or both:

- eviction from the device (the radix cache's LRU over unlocked device leaves) writes a leaf's pages back to
  the host tier, unless they are there already, and keeps the node in the tree with its host copy only (a leaf
  whose write-through has not run yet leaves the tree instead: the next step would wait for that write);
  where the host tier has no room even after dropping its own least recently used leaves, the node and
  whatever hangs below it leave the tree, as without the tier;
- write-through (`--hicache-write-policy write_through`, SGLang's default) copies pages to the host as soon as
  they are cached, so that a later eviction costs no copy; write-back copies them only when evicted;
- a prefix match continues past the device part into nodes held only by the host, and loads them back
  into newly allocated device pages (evicting other device leaves for room if need be) instead of leaving
  those tokens to be computed again; the host copy stays, so evicting such a node again is free;
- an insert that meets a node held only by the host (the request computed the same tokens again) adopts
  the request's device pages for it.

LRU spans both tiers: every node carries one last-access clock; the device evicts its least recently used
leaves to the host, the host drops its least recently used leaves. Device pages never hang below a node
without them, and a node locked by a request always has its device pages.

Invariant (check_counts, under --debug-kv-invariant): the device pool's, plus host free + host held == host
total, no host page held twice, every node on at least one tier with a whole copy there.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from engine.kv_cache import PageAllocator
from engine.kv_events import KVEventRecorder
from engine.kv_host_tier import HostKVPool
from engine.radix_cache import MatchResult, RadixCache, RadixNode

LOAD_OWNER = "host-tier-load"  # the allocator's owner of device pages for a moment, while a load takes them


class HierarchicalRadixCache(RadixCache):
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        host: HostKVPool,
        write_through: bool,
        events: KVEventRecorder | None = None,
    ) -> None:
        super().__init__(page_size, allocator.release, events)
        self.allocator = allocator
        self.host = host
        allocator.on_reuse = host.device_pages_reused  # a page handed out again waits for a copy still reading it
        self.write_through = write_through
        self.host_pages_held = 0
        # The deepest node of a host path being loaded back: the host tier never drops it (nor so its ancestors,
        # which are no leaves) while the load makes room on the device, which may write other pages back.
        self._loading: RadixNode | None = None

    # ---- lookup: the device part, then the host part loaded back ---------------------------
    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        """RadixCache.match_prefix, continued on the host tier: what matches there is loaded back to the device
        (as much as the device pool can take) and is part of the match."""
        usable = len(token_ids) - len(token_ids) % self.page_size
        node, pages, offset = self._descend(token_ids, usable, namespace)
        path = self._host_path(node, token_ids, offset, usable, namespace)
        if path:
            node, loaded = self._load_back(node, path)
            pages = pages + loaded
        return MatchResult(pages, node)

    def _host_path(
        self, node: RadixNode, token_ids: Sequence[int], offset: int, usable: int, namespace: str | None
    ) -> list[RadixNode]:
        """The nodes held only by the host that continue the match below `node` (split where the match ends)."""
        path: list[RadixNode] = []
        now = next(self._clock)
        while offset < usable:
            child = node.children.get(self._child_key(node, token_ids, offset, namespace))
            if child is None:
                break
            assert not child.pages, "device pages below a node held only by the host tier"
            matched = self._common_pages(child.key, token_ids, offset, usable)
            if matched < self.num_pages(child):
                child = self._split(child, matched)
            child.last_access = now
            path.append(child)
            offset += len(child.key)
            node = child
        return path

    def _load_back(self, node: RadixNode, path: list[RadixNode]) -> tuple[RadixNode, list[int]]:
        """Load the path's pages into the device pool, top down, while pages can be had; returns the deepest
        node now on the device and the pages loaded. Each loaded node is locked until the next one is, so that
        making room for the next never evicts it."""
        loaded: list[int] = []
        self.lock(node)
        self._loading = path[-1]
        try:
            for host_node in path:
                need = self.num_pages(host_node)
                if self.allocator.num_free < need:
                    self.evict(need - self.allocator.num_free)
                room = min(need, self.allocator.num_free)
                if room == 0:
                    break
                if room < need:
                    host_node = self._split(host_node, room)  # load what fits; the rest stays on the host
                pages = self.allocator.allocate(LOAD_OWNER, room)
                self.allocator.disown(LOAD_OWNER, room)
                # Evicted leaves' pages come back with the step count their last reader was launched before: the
                # load waits for those steps only, so it overlaps the step in flight where it can.
                self.host.load(host_node.host_pages, pages, self.allocator.unused_since(pages))
                host_node.pages = pages
                self.evictable_pages += room
                self.lock(host_node)
                self.unlock(node)
                node = host_node
                loaded += pages
                if room < need:
                    break
        finally:
            self._loading = None
        self.unlock(node)
        if loaded:
            self.host.stats.hits += 1
        return node, loaded

    # ---- insert: write-through --------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: Sequence[int], namespace: str | None = None) -> MatchResult:
        result = super().insert(token_ids, pages, namespace)
        node = result.node
        if self.write_through and node is not self.root and not node.host_pages:
            self._back_up(node)
        return result

    # ---- eviction: device leaves to the host, host leaves out --------------------------------
    def _steps_launched(self) -> int:
        return self.allocator.steps_launched

    def _evict_leaf(self, leaf: RadixNode) -> None:
        if leaf.host_pages and not leaf.children and self.host.write_pending(leaf.pages):
            # Its write-through has not run: keeping the copy would hold the next step until it has, behind every
            # copy queued before it on the write stream (a pool with no room beyond its running requests evicts
            # what a request cached a moment ago). The node leaves the tree instead, as without the tier.
            self.host.stats.evicted_pages += len(leaf.host_pages)
            self._drop_subtree(leaf)
        elif leaf.host_pages or self._back_up(leaf, evicting=True):
            # Its write (back or through) may still be reading the pages: whoever gets them next waits for it.
            self.allocator.release(leaf.pages, leaf.released_at)
            leaf.pages = []
        else:
            self._drop_subtree(leaf)

    def _back_up(self, node: RadixNode, evicting: bool = False) -> bool:
        """Copy the node's device pages to the host tier, making room there if need be; False if there is none.

        Room for a node leaving the device (`evicting`) comes first from host copies of pages that are on the
        device as well (nothing is lost: they would only be copied again if evicted in turn), then from the
        host's least recently used leaves. A write-through takes free host pages only: it saves a copy later,
        which is not worth a prefix the host alone holds, nor another device node's copy. (SGLang's write-through
        drops the host's least recently used leaves for room. Tried here, it made the host a copy of the device
        once full, the two tiers holding what the host alone holds, not the sum: 200 conversations coming back
        round robin over a host 3x the device pool then never hit; and it did not lower the tier's cost on a
        workload with no reuse, on the H100.)
        """
        need = len(node.pages)
        if self.host.num_free < need and evicting:
            self._drop_host_copies(need - self.host.num_free)
            if self.host.num_free < need:
                self.evict_host(need - self.host.num_free)
        if self.host.num_free < need:
            return False
        node.host_pages = self.host.allocator.allocate(need)
        self.host_pages_held += need
        # A node leaving the device was last written by steps launched before its last request let go of it:
        # its write-back need not wait for the step in flight (which the next step would then wait for).
        self.host.write(node.pages, node.host_pages, computed_before=node.released_at if evicting else None)
        return True

    def evict_host(self, num_pages: int) -> int:
        """Drop at least num_pages host pages (if that many can go), least recently used leaves held only by the
        host first; they leave the tree."""
        heap = [(n.last_access, id(n), n) for n in self._host_leaves()]
        heapq.heapify(heap)
        dropped = 0
        while dropped < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            dropped += len(leaf.host_pages)
            self._drop_subtree(leaf)
            if self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.host.stats.evicted_pages += dropped
        return dropped

    def _drop_host_copies(self, num_pages: int) -> int:
        """Free the host copies of at least num_pages pages that are also on the device (if there are that many),
        most recently used first: those are the last the device will evict."""
        copies, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.pages and node.host_pages:
                copies.append(node)
            stack.extend(node.children.values())
        copies.sort(key=lambda n: n.last_access, reverse=True)
        dropped = 0
        for node in copies:
            if dropped >= num_pages:
                break
            dropped += len(node.host_pages)
            self.host.allocator.release(node.host_pages)
            self.host_pages_held -= len(node.host_pages)
            node.host_pages = []
        self.host.stats.evicted_pages += dropped
        return dropped

    def _is_host_leaf(self, node: RadixNode) -> bool:
        return node is not self.root and not node.pages and not node.children and node is not self._loading

    def _host_leaves(self) -> list[RadixNode]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if self._is_host_leaf(node):
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def _drop_subtree(self, node: RadixNode) -> None:
        """Take the node and everything below it (held only by the host) out of the tree, freeing their pages."""
        for child in list(node.children.values()):
            assert not child.pages and child is not self._loading
            self._drop_subtree(child)
        if node.host_pages:
            self.host.allocator.release(node.host_pages)
            self.host_pages_held -= len(node.host_pages)
            node.host_pages = []
        self._remove(node)
        if node.pages:
            self.host.source_pages_dropped(node.pages)  # a write-through of them may still run: its copy is gone
            self.allocator.release(node.pages, node.released_at)

    def reset(self) -> None:
        """Drop every unlocked node from both tiers (nothing is written back)."""
        while leaves := self._evictable_leaves():  # each round, the parents that became device leaves
            for leaf in leaves:
                self.evictable_pages -= len(leaf.pages)
                self.evicted_pages_total += len(leaf.pages)
                self._drop_subtree(leaf)  # with the nodes held only by the host below it
        self.evict_host(self.host_pages_held)  # below locked nodes too
        if self.events is not None and not self.root.children:
            self.events.cleared()

    # ---- checks ---------------------------------------------------------------------------------
    def check_counts(self) -> None:
        """The device counters, and both tiers: every node whole on at least one tier, device pages only below
        device pages, locks only on the device, host free + held == total with no host page held twice."""
        super().check_counts()
        held: list[int] = []
        stack = [(child, True) for child in self.root.children.values()]
        while stack:
            node, parent_on_device = stack.pop()
            n = self.num_pages(node)
            if (
                len(node.pages) not in (0, n)
                or len(node.host_pages) not in (0, n)
                or not (node.pages or node.host_pages)
            ):
                raise AssertionError(
                    f"hierarchical cache: a node of {n} pages holds {len(node.pages)} on the device, "
                    f"{len(node.host_pages)} on the host"
                )
            if node.pages and not parent_on_device:
                raise AssertionError("hierarchical cache: device pages below a node held only by the host")
            if node.lock_ref and not node.pages:
                raise AssertionError("hierarchical cache: a locked node without device pages")
            held.extend(node.host_pages)
            stack.extend((child, bool(node.pages)) for child in node.children.values())
        if len(held) != self.host_pages_held:
            raise AssertionError(
                f"host tier counter: walk found {len(held)} pages, counter says {self.host_pages_held}"
            )
        self.host.allocator.check_invariant(held)
