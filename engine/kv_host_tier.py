"""The host-memory tier under the radix cache (SGLang's HiCache host pool): its KV pages and the copies to and from
the device pool.

Layout mirrors the device pool (engine/kv_cache.py): per layer, k and v are [num_pages * page_size, kv_heads,
head_dim], views of one host buffer. On CUDA that buffer is page-locked with cudaHostRegister, so that copies run
asynchronously: `pin_memory=True` would go through torch's caching host allocator, which rounds every block up to
a power of two (a 40 GiB tier would take 64). Host page ids run
0..num_pages-1 (no page is reserved: padded rows never write here). Which pages hold what is the radix tree's
business (engine/hierarchical_cache.py); this file moves bytes and counts them.

Ordering on CUDA. Every copy runs on one side stream, in issue order, after the compute stream's work queued
so far (a page written back may still be being written by a launched step; a page loaded into may still be
read by one). Before the next step is launched, `fence()` makes the compute stream wait for the side stream
where it must: after a load (the step may read the pages), and after device pages that were the source of a
copy went back to the free list (`source_pages_freed`: a step may overwrite them), for the last copy that read
those pages only, not for copies issued since (`CopyFence`). A write-through of newly cached pages alone never
holds a step up: those pages stay the tree's, unchanged, until they are evicted, and by then their copy has
usually run, so freeing them waits for nothing. (Waiting for every copy issued so far instead put the compute
stream behind the latest write-through at each eviction: 8% of the throughput of a run whose pool evicted at
every step, in the first H100 run.)
Neither wait blocks the host. Copies among themselves need nothing more: they are in order on the one stream,
so a host page freed and written again, or a device page loaded, evicted and loaded again, sees its copies in
the order the tree made them. An abort or a retraction between a copy and its fence therefore frees pages
safely: whoever reuses them is ordered after the copy. On the CPU (and devices without streams) copies are
plain synchronous tensor copies and the fence does nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_cache import KVCache, KVPool
from engine.transfer import to_device

logger = logging.getLogger(__name__)


@dataclass
class HostTierStats:
    """Counters of the host tier since start (or since the warm-up reset them)."""

    hits: int = 0  # prefix matches that loaded pages back from the host tier
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    written_tokens: int = 0  # written back to (or through to) the host tier
    written_bytes: int = 0
    evicted_pages: int = 0  # dropped from the host tier to make room
    copy_seconds: float = 0.0  # time the copies took (CUDA: measured by events on the side stream)


class HostPageAllocator:
    """Free list of host page ids; lowest ids first, so that a node's pages tend to form one contiguous run."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the host KV tier needs at least one page")
        self.total = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"need {count} host KV pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def check_invariant(self, held: list[int]) -> None:
        """free + held == total; no host page free and held, or held twice."""
        if len(self._free) + len(held) != self.total:
            raise AssertionError(f"host KV tier leak: free {len(self._free)} + held {len(held)} != total {self.total}")
        if len(set(self._free) | set(held)) != self.total:
            raise AssertionError(
                f"host KV pages double-booked: {len(set(self._free) | set(held))} distinct of {self.total}"
            )


class Completion(Protocol):
    def query(self) -> bool: ...  # torch.cuda.Event: whether the work before it has run


class CopyFence:
    """Which copy the next step must wait for, by issue number (copies run in issue order on one stream, so
    waiting for the latest one needed covers every earlier one): the last load (the step reads its pages), and
    of the copies that read device pages since freed, the last one not yet run. Copies of pages the tree still
    holds are never waited for."""

    def __init__(self) -> None:
        self._readers: dict[int, tuple[int, Completion]] = {}  # device page -> the last copy that read it
        self._needed: tuple[int, Completion] | None = None

    def read_pages(self, pages: list[int], issued: int, end: Completion) -> None:
        for page in pages:
            self._readers[page] = (issued, end)

    def wait_for(self, issued: int, end: Completion) -> None:
        if self._needed is None or self._needed[0] < issued:
            self._needed = (issued, end)

    def pages_freed(self, pages: list[int]) -> None:
        """These device pages went back to the free list: a step may overwrite them once their copies ran."""
        last = max(
            (self._readers.pop(page) for page in pages if page in self._readers), key=lambda r: r[0], default=None
        )
        if last is not None and not last[1].query():
            self.wait_for(*last)

    def take(self) -> Completion | None:
        """The copy the next step waits for (None: none), and no wait owed after it."""
        needed, self._needed = self._needed, None
        return needed[1] if needed is not None else None


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index into pages, first page, count) of each run of consecutive page ids."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs


class HostKVPool:
    """The host tier's k/v tensors, its page allocator, and the copies between it and the device pool."""

    def __init__(self, device_pool: KVPool, num_pages: int, device: torch.device) -> None:
        self.page_size = device_pool.page_size
        self.device = device
        self.device_caches = device_pool.caches
        k0 = device_pool.caches[0][0]
        pin = device.type == "cuda"  # page-locked memory is what makes a host<->GPU copy asynchronous
        num_slots = num_pages * self.page_size
        shapes = [(num_slots, *t.shape[1:]) for kv in device_pool.caches for t in kv]
        sizes = [torch.Size(shape).numel() * k0.element_size() for shape in shapes]
        self._buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        self._registered = pin and self._register(sum(sizes))
        views = [
            part.view(k0.dtype).view(shape)
            for part, shape in zip(torch.split(self._buffer, sizes), shapes, strict=True)
        ]
        self.caches: list[KVCache] = [(views[i], views[i + 1]) for i in range(0, len(views), 2)]
        self.bytes_per_page = sum(k[0].nbytes + v[0].nbytes for k, v in device_pool.caches) * self.page_size
        self.allocator = HostPageAllocator(num_pages)
        self.stats = HostTierStats()
        self._slot_offsets = torch.arange(self.page_size)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._issued = 0  # copies issued on the side stream
        self._fence = CopyFence()
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # copies not yet measured
        logger.info(
            "host KV tier: %d pages x %d tokens (%.1f MiB%s), dtype %s",
            num_pages,
            self.page_size,
            self.nbytes() / 2**20,
            ", page-locked" if self._registered else "",
            k0.dtype,
        )

    def _register(self, nbytes: int) -> bool:
        """Page-lock the buffer; where that fails (a locked-memory limit) the tier still works, its copies
        synchronous."""
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self._buffer.data_ptr(), nbytes, 0))
        except RuntimeError as exc:
            logger.warning(
                "host KV tier: cudaHostRegister of %.1f GiB failed (%s): copies will not overlap", nbytes / 2**30, exc
            )
            return False
        return True

    @staticmethod
    def num_pages_for(device_pool: KVPool, size_gib: float, ratio: float) -> int:
        """Host pages for --hicache-size (GiB; wins when > 0) or --hicache-ratio (times the device pool's pages)."""
        if size_gib > 0:
            per_page = device_pool.nbytes() // device_pool.num_pages
            return int(size_gib * 2**30) // per_page
        return int(device_pool.allocator.total * ratio)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    # ---- copies ---------------------------------------------------------------------------
    def write(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (a write-back, or a write-through of newly cached pages)."""
        self._copy(device_pages, host_pages, to_host=True)  # the next step need not wait: nothing reads these pages
        self.stats.written_tokens += len(host_pages) * self.page_size
        self.stats.written_bytes += len(host_pages) * self.bytes_per_page

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (a prefix hit on the host tier)."""
        end = self._copy(device_pages, host_pages, to_host=False)
        if end is not None:
            self._fence.wait_for(self._issued, end)  # the next step reads them
        self.stats.loaded_tokens += len(host_pages) * self.page_size
        self.stats.loaded_bytes += len(host_pages) * self.bytes_per_page

    def _slots(self, pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size + self._slot_offsets).flatten()

    def _copy(self, device_pages: list[int], host_pages: list[int], to_host: bool) -> torch.cuda.Event | None:
        """Issue the copy; its end event on the side stream (None: it has run, synchronously)."""
        assert len(device_pages) == len(host_pages)
        if not host_pages:
            return None
        if self._stream is None:
            start = time.perf_counter()
            self._copy_sync(self._slots(device_pages), self._slots(host_pages), to_host)
            self.stats.copy_seconds += time.perf_counter() - start
            return None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # after the launched steps that write (or still read) these pages
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record(self._stream)
            device_slots = to_device(self._slots(device_pages), torch.int64, self.device)
            ps = self.page_size
            # Cross-device index ops do not exist: one slice copy per run of consecutive host pages
            # (the allocator hands out low ids first, so a node's pages are mostly one run).
            for index, first, count in _runs(host_pages):
                rows = device_slots[index * ps : (index + count) * ps]
                host_rows = slice(first * ps, (first + count) * ps)
                for (dk, dv), (hk, hv) in zip(self.device_caches, self.caches):
                    for dev, host in ((dk, hk), (dv, hv)):
                        if to_host:
                            host[host_rows].copy_(dev.index_select(0, rows), non_blocking=True)
                        else:
                            dev.index_copy_(0, rows, host[host_rows].to(self.device, non_blocking=True))
            end.record(self._stream)
        self._issued += 1
        if to_host:
            self._fence.read_pages(device_pages, self._issued, end)
        self._timings.append((begin, end))
        return end

    def _copy_sync(self, device_slots: torch.Tensor, host_slots: torch.Tensor, to_host: bool) -> None:
        """CPU, and devices without streams: gather, move, scatter; one pass per layer and tensor."""
        device_slots = device_slots.to(self.device)
        for (dk, dv), (hk, hv) in zip(self.device_caches, self.caches):
            for dev, host in ((dk, hk), (dv, hv)):
                if to_host:
                    host.index_copy_(0, host_slots, dev.index_select(0, device_slots).to("cpu"))
                else:
                    dev.index_copy_(0, device_slots, host.index_select(0, host_slots).to(self.device))

    def source_pages_freed(self, device_pages: list[int]) -> None:
        """These device pages went back to the free list: the next step waits for the last copy that read them
        before it can overwrite them, if that copy has not run yet."""
        self._fence.pages_freed(device_pages)

    def fence(self) -> None:
        """Before a step is launched: the compute stream waits for the copy it needs (never the host)."""
        needed = self._fence.take()
        if needed is not None:
            assert isinstance(needed, torch.cuda.Event)
            torch.cuda.current_stream(self.device).wait_event(needed)
        while self._timings and self._timings[0][1].query():  # in issue order: the first unfinished ends it
            begin, end = self._timings.pop(0)
            self.stats.copy_seconds += begin.elapsed_time(end) / 1000.0

    def close(self) -> None:
        """Unpin the buffer (engine shutdown); after every copy has run. The tier is not used afterwards."""
        self.synchronize()
        if self._registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr()))
            self._registered = False

    def synchronize(self) -> None:
        """Wait until every copy issued so far has run (benchmarks, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()
            self.fence()
