"""The one capture loop every runner captures through: its sizes in order under a progress bar, each
timed, and one log line of what was captured, how long it took and how much device memory it holds.

A runner keeps only what differs per platform, the body of the loop (a CUDA/HIP graph capture into
one pool, an aclgraph, a torch.compile warm-up, an HPU bucket's warm-up):

    for size in capture_loop(self.report, sizes):
        ...capture size...

Sizes go largest first by default: a graph pool then serves every smaller graph from the blocks the
largest one left (CUDA, HIP, NPU). A runner with no pool may choose another order and say why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger(__name__)

Size = TypeVar("Size", bound=Hashable)


@dataclass
class CaptureReport:
    """What one runner captured: set by capture_loop, read by logs, benchmarks and tests."""

    what: str  # "CUDA decode graphs", "extend graphs", "HPU prefill buckets", ...
    sizes: list[object] = field(default_factory=list)
    seconds: float = 0.0
    memory_bytes: int = 0  # device memory the captured work holds (0 where the platform cannot tell)
    seconds_per_size: dict[object, float] = field(default_factory=dict)


def capture_loop(
    report: CaptureReport,
    sizes: Iterable[Size],
    *,
    largest_first: bool = True,
    free_memory: Callable[[], int] | None = None,
    extra: Callable[[], str] | None = None,
    progress: bool = True,
) -> Iterator[Size]:
    """Yield each size for the caller to capture, in order, timing each; log the whole when done.

    free_memory: the device's free bytes (the memory the captures took is the drop across the loop).
    extra: more to say in the log line (compile counts, warm-up split), called once at the end. progress: a
    progress bar where the output is a terminal. A body that raises ends the loop without the log: the error
    says what happened."""
    ordered = sorted(set(sizes), reverse=largest_first)  # type: ignore[type-var]
    report.sizes = list(ordered)
    free_before = free_memory() if free_memory is not None else 0
    start = time.perf_counter()
    for size in tqdm(ordered, desc=f"Capturing {report.what}", unit="size", disable=None if progress else True):
        size_start = time.perf_counter()
        yield size
        report.seconds_per_size[size] = time.perf_counter() - size_start
    report.seconds = time.perf_counter() - start
    if free_memory is not None:
        report.memory_bytes = max(0, free_before - free_memory())
    slowest = sorted(report.seconds_per_size.items(), key=lambda item: -item[1])[:3]
    more = extra() if extra is not None else ""
    logger.info(
        "captured %s %s in %.1f s (slowest: %s)%s%s",
        report.what,
        _sizes_text(report.sizes),
        report.seconds,
        ", ".join(f"{size} {seconds:.1f} s" for size, seconds in slowest),
        f", memory {report.memory_bytes / 2**20:.1f} MiB" if free_memory is not None else "",
        f"; {more}" if more else "",
    )


def _sizes_text(sizes: list[object]) -> str:
    return str(sizes) if len(sizes) <= 12 else f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}] ({len(sizes)} sizes)"
