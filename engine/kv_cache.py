"""The paged KV pool and its page allocator.

Layout per layer: k and v are [num_pages * page_size, kv_heads, head_dim];
slot = page * page_size + offset. Page 0 is never handed out: padded rows of
a captured batch write their k/v there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.errors import EngineError

KVCache = tuple[torch.Tensor, torch.Tensor]


class OutOfPagesError(EngineError):
    """The pool has fewer free pages than asked for."""


class PageAllocator:
    """Free list of page ids 1..num_pages-1 with ownership tracking for the leak invariant."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._owned: dict[str, list[int]] = {}
        # Steps launched so far (KVCacheManager.fence advances it before every launch), and per page the count
        # when it was last freed: no step launched after that reads or writes it, so a copy into the page (the
        # host tier's load) waits for the steps before that count only, not for the step in flight.
        self.steps_launched = 0
        self._freed_at = [0] * num_pages
        self.allocated_total = 0  # pages handed out since start (how many a step takes: KVCacheManager.fence)
        # Told of every page handed out again: the host tier makes the next step wait for a copy still reading
        # one (engine/kv_host_tier.py), which is why a freed page need not wait for its copy when it is freed.
        self.on_reuse: Callable[[list[int]], None] | None = None

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return sum(len(pages) for pages in self._owned.values())

    def allocate(self, owner: str, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self._owned.setdefault(owner, []).extend(pages)
        self.allocated_total += count
        if self.on_reuse is not None:
            self.on_reuse(pages)
        return pages

    def free(self, owner: str) -> int:
        pages = self._owned.pop(owner, [])
        self._stamp(pages, self.steps_launched)
        self._free.extend(reversed(pages))
        return len(pages)

    def free_last(self, owner: str, count: int) -> int:
        """Free the owner's last `count` pages (none when count <= 0); how many were freed."""
        pages = self._owned.get(owner, [])
        if count <= 0 or not pages:
            return 0
        count = min(count, len(pages))
        freed, self._owned[owner] = pages[-count:], pages[:-count]
        if not self._owned[owner]:
            del self._owned[owner]
        self._stamp(freed, self.steps_launched)
        self._free.extend(reversed(freed))
        return count

    def disown(self, owner: str, count: int) -> list[int]:
        """Hand the owner's first `count` pages to someone else (the prefix cache) without freeing them."""
        pages = self._owned.get(owner, [])
        if count > len(pages):
            raise ValueError(f"{owner} owns {len(pages)} pages, cannot hand over {count}")
        moved, self._owned[owner] = pages[:count], pages[count:]
        if not self._owned[owner]:
            del self._owned[owner]
        return moved

    def release(self, pages: list[int], last_used_before: int | None = None) -> None:
        """Return pages nobody owns any more (evicted from the prefix cache, or duplicates of cached ones).
        `last_used_before`: no step launched from that count on uses them (default: the steps launched so far)."""
        self._stamp(pages, self.steps_launched if last_used_before is None else last_used_before)
        self._free.extend(reversed(pages))

    def _stamp(self, pages: list[int], steps: int) -> None:
        for page in pages:
            self._freed_at[page] = steps

    def unused_since(self, pages: list[int]) -> int:
        """The step count from which no launched step uses these (free, or just allocated) pages."""
        return max((self._freed_at[page] for page in pages), default=0)

    def pages_of(self, owner: str) -> list[int]:
        return self._owned.get(owner, [])

    def check_invariant(self, cached_pages: list[int] | None = None) -> None:
        """free + cached + in use == total; no page is free and held, held twice, or page 0.

        `cached_pages` are the pages the prefix cache holds (evictable or protected).
        """
        owned = [p for pages in self._owned.values() for p in pages]
        cached = cached_pages or []
        if len(self._free) + len(cached) + len(owned) != self.total:
            raise AssertionError(
                f"KV leak: free {len(self._free)} + cached {len(cached)} + in use {len(owned)} != total {self.total}"
            )
        everything = set(owned) | set(self._free) | set(cached)
        if len(everything) != self.total or 0 in everything:
            raise AssertionError(
                f"KV pages double-booked or page 0 handed out: {len(everything)} distinct of {self.total} "
                f"(free {len(self._free)}, cached {len(cached)}, in use {len(owned)})"
            )


class KVPool:
    """Per-layer k/v tensors on the device plus the allocator of their pages."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        num_slots = num_pages * page_size
        self.caches: list[KVCache] = [
            (
                torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        self.allocator = PageAllocator(num_pages)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.total * self.page_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)
