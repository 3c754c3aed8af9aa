"""The host-memory tier under the radix cache (SGLang's HiCache host pool): its KV pages and the copies to and from
the device pool.

Layout: page-major, one host buffer [num_pages, layers * 2, page words] (a page's k and v of every layer, one
after the other), so that a run of consecutive host pages is one contiguous block and one memcpy. The device
pool keeps per-layer k and v tensors (engine/kv_cache.py); a `PageMover` gathers the pages of a copy from all of
them into a staging buffer of the host layout (or scatters them back) in one pass: one Triton kernel on CUDA
(backends/cuda/kv_pages.py) instead of one gather per layer and tensor, which put 64 small kernels per copy
for Llama-3-8B beside the compute stream's. On CUDA the host buffer is page-locked with cudaHostRegister, so that
copies run asynchronously: `pin_memory=True` would go through torch's caching host allocator, which rounds every
block up to a power of two (a 40 GiB tier would take 64). Host page ids run 0..num_pages-1 (no page is reserved:
padded rows never write here). Which pages hold what is the radix tree's business
(engine/hierarchical_cache.py); this file moves bytes and counts them.

Ordering on CUDA. Writes (device to host) run on one side stream, loads (host to device) on another, each in
issue order. A write-through runs after the compute stream's work queued so far (a launched step may still be
computing its pages); a write-back of an evicted node after the steps launched before its last request let go
of it only, so that it overlaps the step in flight; both after the last load (which may still read host pages
freed and now written again). A load runs
after the steps that may still use its device pages, and no others: the allocator stamps each page with the
count of steps launched when it was freed (a radix node's pages, when the last request let go of the node), and
`StepEnds` holds an event recorded before each launch, so a load into pages evicted from the cache long ago
overlaps the step in flight; it also waits for a write still reading its device pages or still writing its host
pages. Before the next step is launched, `fence()` makes the compute stream wait for the side streams where it
must: after a load (the step may read the pages), and after device pages that were the source of a write were
handed out again (`device_pages_reused`, told by the allocator: a step may overwrite them), for the last write that
read those pages only, not for copies issued since (`CopyFence`, one per stream). Freeing a page waits for
nothing: the KV manager evicts a step's worth of pages ahead of need (KVCacheManager.fence), so their write-backs
run beside the step in flight and have usually run when the next step takes the pages. A write-through of newly
cached pages alone never holds a step up: those pages stay the tree's, unchanged, until they are evicted, and by
then their copy has usually run. (Waiting for every copy issued so far instead put the
compute stream behind the latest write-through at each eviction: 8% of the throughput of a run whose pool
evicted at every step, in the first H100 run.) Pages evicted before their write-through has run are dropped with
their unfinished host copy instead (`source_pages_dropped`, engine/hierarchical_cache.py): waiting for that write
also waited for every copy queued before it, ~20 ms a step on an H100 where the pool had no room beyond its
running requests. Neither wait blocks the host. An abort or a retraction between a
copy and its fence therefore frees pages safely: whoever reuses them is ordered after the copy. On the CPU (and
devices without streams) copies are plain synchronous tensor copies and the fence does nothing.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

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
    evicted_pages: int = 0  # dropped from the host tier to make room, or evicted from the device before written
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

    def pages_reused(self, pages: list[int]) -> None:
        """These device pages were handed out again: the next step may overwrite them, so it waits for the last
        copy that read them if that copy has not run. (Freeing them waits for nothing: a page evicted ahead of
        need has usually been copied by the time it is handed out.)"""
        last = max(
            (self._readers.pop(page) for page in pages if page in self._readers), key=lambda r: r[0], default=None
        )
        if last is not None and not last[1].query():
            self.wait_for(*last)

    def forget(self, pages: list[int]) -> None:
        """These device pages went back to the free list and no one reads what their copies make: no wait."""
        for page in pages:
            self._readers.pop(page, None)

    def take(self) -> Completion | None:
        """The copy the next step waits for (None: none), and no wait owed after it."""
        needed, self._needed = self._needed, None
        return needed[1] if needed is not None else None


class StepEnds:
    """Which launched steps have run, as far as the host needs to know: before each launch the compute stream
    records an end (all steps launched before it have run). A load into device pages that no step launched
    from count T on uses waits for the end recorded before step T, not for the step in flight."""

    def __init__(self) -> None:
        self._ends: collections.deque[tuple[int, Completion]] = collections.deque()  # (step, end before it)
        self._done_before = 0  # every step below this count is known to have run
        self._next = 0  # the count of the next step to launch

    def launching(self, step: int, end: Completion) -> None:
        """Step `step` is about to be launched; `end` marks the end of every step before it."""
        self._ends.append((step, end))
        self._next = step + 1
        while self._ends and self._ends[0][1].query():
            self._done_before = max(self._done_before, self._ends.popleft()[0])

    def before(self, step: int) -> Completion | bool | None:
        """What a copy must wait for so that every step below count `step` has run: nothing (None), an end
        (a Completion), or True: all queued work (no step launched since that count, so no end marks it)."""
        if step <= self._done_before:
            return None
        if step >= self._next:
            return True
        for recorded, end in self._ends:
            if recorded == step:
                return None if end.query() else end
        return True  # not reached: every count since the last known to have run has its end


STAGING_BYTES = 64 * 2**20  # the most a copy stages on the device at once (pages of every layer)


def page_words(device_pool: KVPool) -> tuple[torch.dtype, int]:
    """The word a page is moved in (int32 where a tensor's page is a whole number of them, else bytes) and how
    many of them one tensor's page holds."""
    k0 = device_pool.caches[0][0]
    page_bytes = device_pool.page_size * k0[0].numel() * k0.element_size()
    word = torch.int32 if page_bytes % 4 == 0 and k0.shape[-1] * k0.element_size() % 4 == 0 else torch.uint8
    return word, page_bytes // torch.empty((), dtype=word).element_size()


def page_rows(tensor: torch.Tensor, word: torch.dtype, words_per_page: int) -> torch.Tensor:
    """A pool tensor [slots, kv_heads, head_dim] as [pages, page words]: a view, no copy."""
    return tensor.view(word).view(-1, words_per_page)


class PageMover(Protocol):
    """Moves whole pages between the device pool's per-layer tensors and a staging buffer in the host tier's
    layout [pages, tensors, page words]: `gather` reads `pages` (int64, on the pool's device) of every tensor
    into `staging`, `scatter` writes them back. `tensors` is the pool's k and v of every layer, in that order."""

    def gather(self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None: ...

    def scatter(self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None: ...


class TorchPageMover:
    """Any device: one index_select (or index_copy_) per tensor."""

    def gather(self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None:
        for index, tensor in enumerate(tensors):
            staging[:, index] = page_rows(tensor, staging.dtype, staging.shape[2]).index_select(0, pages)

    def scatter(self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None:
        for index, tensor in enumerate(tensors):
            page_rows(tensor, staging.dtype, staging.shape[2]).index_copy_(0, pages, staging[:, index])


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
    """The host tier's pages, its page allocator, and the copies between it and the device pool."""

    def __init__(
        self, device_pool: KVPool, num_pages: int, device: torch.device, mover: PageMover | None = None
    ) -> None:
        self.page_size = device_pool.page_size
        self.device = device
        self.device_tensors = [t for kv in device_pool.caches for t in kv]  # k and v of every layer, in order
        self.mover: PageMover = mover or TorchPageMover()
        self._word, words = page_words(device_pool)
        k0 = device_pool.caches[0][0]
        self._kv_dtype, self._kv_row_shape = k0.dtype, tuple(k0.shape[1:])
        pin = device.type == "cuda"  # page-locked memory is what makes a host<->GPU copy asynchronous
        self.pages = torch.empty(num_pages, len(self.device_tensors), words, dtype=self._word)
        self._registered = pin and self._register(self.pages.nbytes)
        self.bytes_per_page = self.pages[0].nbytes
        # Pages per staged chunk: at most STAGING_BYTES of device memory beside the pool, whatever the copy's size.
        self._chunk_pages = max(1, STAGING_BYTES // self.bytes_per_page)
        self.allocator = HostPageAllocator(num_pages)
        self.stats = HostTierStats()
        # Writes (device to host) and loads (host to device) on side streams of their own: a write waits for the
        # step that computed its pages, and a load queued behind it could not overlap that step.
        cuda = device.type == "cuda"
        self._write_stream = torch.cuda.Stream(device) if cuda else None
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        self._issued = 0  # copies issued on either stream, in order
        self._write_fence, self._load_fence = CopyFence(), CopyFence()  # per stream: each runs its copies in order
        self._steps = StepEnds()
        # The copies a load may have to wait for on the other stream: per host page the last write into it, per
        # device page the last write that read it (kept after the page is freed, unlike the fence's).
        self._host_written: dict[int, Completion] = {}
        self._device_read: dict[int, Completion] = {}
        self._last_load: Completion | None = None
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # copies not yet measured
        logger.info(
            "host KV tier: %d pages x %d tokens (%.1f MiB%s), dtype %s, pages moved by %s",
            num_pages,
            self.page_size,
            self.nbytes() / 2**20,
            ", page-locked" if self._registered else "",
            k0.dtype,
            type(self.mover).__name__,
        )

    def _register(self, nbytes: int) -> bool:
        """Page-lock the buffer; where that fails (a locked-memory limit) the tier still works, its copies
        synchronous."""
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.pages.data_ptr(), nbytes, 0))
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

    @property
    def copies_asynchronously(self) -> bool:
        """Whether copies run on side streams (CUDA), not synchronously on the host."""
        return self._write_stream is not None

    def nbytes(self) -> int:
        return self.pages.nbytes

    def slot_caches(self) -> list[KVCache]:
        """The tier's contents in the device pool's layout (per layer, k and v of [slots, kv_heads, head_dim]):
        copies, for tests and debugging."""
        num_tensors = len(self.device_tensors)
        by_tensor = self.pages.permute(1, 0, 2).contiguous().view(self._kv_dtype)
        slots = [by_tensor[t].reshape(-1, *self._kv_row_shape) for t in range(num_tensors)]
        return [(slots[i], slots[i + 1]) for i in range(0, num_tensors, 2)]

    # ---- copies ---------------------------------------------------------------------------
    def write(self, device_pages: list[int], host_pages: list[int], computed_before: int | None = None) -> None:
        """Copy device pages into host pages (a write-back, or a write-through of newly cached pages). On CUDA
        after the steps that may still be computing these pages: those launched before count `computed_before`
        (a write-back of a cache node: the steps before its last request let go of it, so the copy overlaps the
        step in flight), or every launched step (None: a write-through of pages just computed); and after the
        last load (it may still read host pages freed and now written again)."""
        end = self._copy(device_pages, host_pages, to_host=True, after_steps_before=computed_before)
        if end is not None:
            self._write_fence.read_pages(device_pages, self._issued, end)  # a step may overwrite them once freed
            for page in device_pages:
                self._device_read[page] = end
            for page in host_pages:
                self._host_written[page] = end
        self.stats.written_tokens += len(host_pages) * self.page_size
        self.stats.written_bytes += len(host_pages) * self.bytes_per_page

    def load(self, host_pages: list[int], device_pages: list[int], unused_since: int | None = None) -> None:
        """Copy host pages into device pages (a prefix hit on the host tier). `unused_since`: no step launched
        from that count on uses the device pages (PageAllocator.unused_since), so on CUDA the load waits for
        the steps before it only and overlaps the step in flight where those have run (None: after every
        launched step). It also waits for a write still reading the device pages or still writing the host
        pages, never for other writes."""
        end = self._copy(device_pages, host_pages, to_host=False, after_steps_before=unused_since)
        if end is not None:
            self._load_fence.wait_for(self._issued, end)  # the next step reads them
            self._last_load = end
        self.stats.loaded_tokens += len(host_pages) * self.page_size
        self.stats.loaded_bytes += len(host_pages) * self.bytes_per_page

    def _copy(
        self, device_pages: list[int], host_pages: list[int], to_host: bool, after_steps_before: int | None
    ) -> torch.cuda.Event | None:
        """Issue the copy; its end event on its side stream (None: it has run, synchronously)."""
        assert len(device_pages) == len(host_pages)
        if not host_pages:
            return None
        stream = self._write_stream if to_host else self._load_stream
        if stream is None:
            start = time.perf_counter()
            self._move(device_pages, host_pages, to_host)
            self.stats.copy_seconds += time.perf_counter() - start
            return None
        compute = torch.cuda.current_stream(self.device)
        steps = True if after_steps_before is None else self._steps.before(after_steps_before)
        if steps is True:
            stream.wait_stream(compute)  # after the launched steps that write (or still read) these pages
        elif isinstance(steps, torch.cuda.Event):
            stream.wait_event(steps)
        for pending in self._other_stream_copies(device_pages, host_pages, to_host):
            stream.wait_event(pending)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record(stream)
            self._move(device_pages, host_pages, to_host)
            end.record(stream)
        self._issued += 1
        self._timings.append((begin, end))
        return end

    def _other_stream_copies(self, device_pages: list[int], host_pages: list[int], to_host: bool) -> list[Any]:
        """Copies on the other side stream this one must follow: for a write, the last load if it has not run;
        for a load, the writes still reading its device pages or still writing its host pages."""
        if to_host:
            pending = [self._last_load] if self._last_load is not None else []
        else:
            pending = [self._device_read[p] for p in device_pages if p in self._device_read]
            pending += [self._host_written[p] for p in host_pages if p in self._host_written]
        unique = {id(event): event for event in pending}
        return [event for event in unique.values() if not event.query()]

    def _move(self, device_pages: list[int], host_pages: list[int], to_host: bool) -> None:
        """In chunks of at most STAGING_BYTES: the chunk's pages of every layer gathered into one staging buffer
        of the host layout and copied with one memcpy per run of consecutive host pages (the allocator hands
        out low ids first, so a node's pages are mostly one run); a load the other way round. On CUDA this runs
        on the side stream, and the staging buffer, allocated there, is reused only after its copy has run."""
        chunk = self._chunk_pages
        for offset in range(0, len(device_pages), chunk):
            dev = to_device(device_pages[offset : offset + chunk], torch.int64, self.device)
            staging = torch.empty((len(dev), *self.pages.shape[1:]), dtype=self._word, device=self.device)
            runs = _runs(host_pages[offset : offset + chunk])
            if to_host:
                self.mover.gather(self.device_tensors, dev, staging)
            for index, first, count in runs:
                host_rows = self.pages[first : first + count]
                if to_host:
                    host_rows.copy_(staging[index : index + count], non_blocking=True)
                else:
                    staging[index : index + count].copy_(host_rows, non_blocking=True)
            if not to_host:
                self.mover.scatter(self.device_tensors, dev, staging)

    def device_pages_reused(self, device_pages: list[int]) -> None:
        """These device pages were handed out again (PageAllocator.on_reuse): the next step waits for the last
        copy that read them before it can overwrite them, if that copy has not run yet."""
        self._write_fence.pages_reused(device_pages)

    def write_pending(self, device_pages: list[int]) -> bool:
        """Whether a write that reads these device pages has not run yet (never, where copies are synchronous)."""
        return any(not self._device_read[page].query() for page in device_pages if page in self._device_read)

    def source_pages_dropped(self, device_pages: list[int]) -> None:
        """These device pages went back to the free list, and the host copy a write was making of them (if any) was
        dropped with them: nothing will read it, so no step waits for the write (a step that overwrites the pages
        while it runs only spoils that copy; a later write into its host pages runs after it on the same stream,
        and a load from them waits for that later write)."""
        self._write_fence.forget(device_pages)

    def fence(self, step: int | None = None) -> None:
        """Before step number `step` is launched: the compute stream waits for the copies it needs (never the
        host), and marks where the steps before it end (StepEnds)."""
        if self._write_stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        if step is not None:
            steps_end = torch.cuda.Event()
            steps_end.record(compute)
            self._steps.launching(step, steps_end)
        for fence in (self._write_fence, self._load_fence):
            needed = fence.take()
            if needed is not None:
                assert isinstance(needed, torch.cuda.Event)
                compute.wait_event(needed)
        self._measure_finished_copies()

    def _measure_finished_copies(self) -> None:
        # In issue order across both streams: the first unfinished ends the pass (the rest wait for the next).
        while self._timings and self._timings[0][1].query():
            begin, end = self._timings.pop(0)
            self.stats.copy_seconds += begin.elapsed_time(end) / 1000.0

    def close(self) -> None:
        """Unpin the buffer (engine shutdown); after every copy has run. The tier is not used afterwards."""
        self.synchronize()
        if self._registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.pages.data_ptr()))
            self._registered = False

    def synchronize(self) -> None:
        """Wait until every copy issued so far has run (benchmarks, shutdown)."""
        for stream in (self._write_stream, self._load_stream):
            if stream is not None:
                stream.synchronize()
        self._measure_finished_copies()
