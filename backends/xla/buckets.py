"""Which bucket a step is padded to, and how a step larger than every bucket is split: pure host logic."""

from __future__ import annotations

from engine.capture_sizes import smallest_bucket_at_least


def bucket_for(buckets: list[int], n: int) -> int:
    """The smallest bucket that holds n (buckets sorted); n must not exceed the largest."""
    size = smallest_bucket_at_least(buckets, n)
    if size is None:
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return size


def split(n: int, largest: int) -> list[tuple[int, int]]:
    """[start, end) pieces of at most `largest` covering range(n), in order: a decode batch past the largest
    decode bucket, or a prompt chunk past the largest prefill bucket, runs as several programs one after the
    other (a later piece sees the KV an earlier one wrote)."""
    return [(start, min(start + largest, n)) for start in range(0, n, largest)]
