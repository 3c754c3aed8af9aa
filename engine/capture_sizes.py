"""Capture sizes and padding: which captured size serves a batch of n."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence


def parse_sizes(spec: str | Sequence[int] | None) -> list[int] | None:
    """'1,2,4,8' or [1, 2, 4, 8] -> sorted unique positive ints; None stays None."""
    if spec is None:
        return None
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        try:
            values = [int(p) for p in parts]
        except ValueError as exc:
            raise ValueError(f"capture sizes must be comma-separated integers, got {spec!r}") from exc
    else:
        values = [int(v) for v in spec]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"capture sizes must be positive integers, got {spec!r}")
    return sorted(set(values))


def default_capture_sizes(max_size: int, dense_until: int = 8, step: int = 8) -> list[int]:
    """Powers of two up to `dense_until`, then every `step` (SGLang/vLLM style)."""
    sizes: list[int] = []
    size = 1
    while size <= min(dense_until, max_size):
        sizes.append(size)
        size *= 2
    size = (sizes[-1] if sizes else 0) + step
    while size <= max_size:
        sizes.append(size)
        size += step
    if max_size not in sizes:
        # The configured maximum is always captured (SGLang PR #21005 was a silent miss).
        sizes.append(max_size)
    return sorted(set(sizes))


def cap_sizes(sizes: Iterable[int], max_size: int) -> list[int]:
    """Drop sizes above max_size, but keep max_size itself captured."""
    kept = sorted({s for s in sizes if s <= max_size})
    if not kept or kept[-1] < max_size:
        kept.append(max_size)
    return kept


def smallest_bucket_at_least(sizes: Sequence[int], n: int) -> int | None:
    """The smallest captured size >= n, or None when n is beyond the largest."""
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None
