"""Capture-size selection for the accelerators with other graph constraints: Gaudi's (batch, blocks)
buckets and Ascend's graph budget. Device-independent; tested on CPU; NEVER RUN ON GAUDI OR ASCEND.

HPU: a decode step of n rows needing k KV blocks runs the bucket (bs, blocks) with bs the smallest batch
bucket >= n and blocks the smallest block bucket of that bs >= k + (bs - n) (each padded row reads the
dummy page: backends/hpu/bucketing.choose_decode_bucket). Every (bs, blocks) pair is compiled at warm-up,
so the budget is a number of buckets (or their warm-up seconds). The block buckets are one list for all
batch buckets, generated from a {min, step, max} range (the form configs/hpu.yaml and the
ENGINE_DECODE_BLOCK_BUCKET_* variables take), so the proposal is searched over ranges: for each range,
the best batch buckets come from the same dynamic programme as the other devices (engine/tuning/select.py),
each batch bucket costing the block buckets it brings.

NPU: aclgraph holds a bounded number of graphs per process (npu_graph_budget of the layer count); the
tuner passes it as Budget.max_graphs, so the runner never has to sample the tuned sizes down.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from backends.hpu.bucketing import BucketRange, decode_buckets, make_buckets
from engine.tuning.distribution import SizeDistribution
from engine.tuning.select import Budget, SizeCost, pareto_select

StepDistribution = Mapping[tuple[int, int], float]  # (rows, KV blocks needed) -> probability


@dataclass(frozen=True)
class PlaneCost:
    """Step milliseconds as a + b * batch + c * blocks, least squares over measured (batch, blocks, ms) points:
    a Gaudi decode step is a weight read (a) plus per-row and per-block work, and a plane needs only three
    measured buckets to price any other."""

    a: float
    b: float
    c: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> PlaneCost:
        if len(points) < 3:
            raise ValueError("need at least three (batch, blocks, ms) points to fit a step-time plane")
        x = np.array([[1.0, bs, blocks] for bs, blocks, _ in points])
        y = np.array([ms for _, _, ms in points])
        a, b, c = np.linalg.lstsq(x, y, rcond=None)[0]
        return cls(float(a), float(b), float(c))

    def __call__(self, bs: int, blocks: int) -> float:
        return max(0.0, self.a + self.b * bs + self.c * blocks)


def step_distribution(batch: SizeDistribution, context_tokens: int, page_size: int) -> dict[tuple[int, int], float]:
    """(rows, blocks) of each decode step when every row holds `context_tokens` (the simplest model of a
    block distribution: blocks = rows x pages per row)."""
    per_row = math.ceil(context_tokens / page_size)
    return {(n, n * per_row): p for n, p in batch.weights.items()}


@dataclass(frozen=True)
class HpuProposal:
    batch_buckets: tuple[int, ...]
    block_range: BucketRange
    strategy: str
    block_buckets: tuple[int, ...]
    buckets: int  # (bs, blocks) pairs warmed up
    expected_ms: float
    padded_rows: float  # mean per step
    padded_blocks: float  # mean per step, padded rows' dummy blocks included

    def config(self) -> dict[str, object]:
        """The keys configs/hpu.yaml takes: batch buckets as capture_sizes, blocks as a range."""
        r = self.block_range
        return {
            "capture_sizes": list(self.batch_buckets),
            "max_capture_size": max(self.batch_buckets),
            "hpu": {"bucketing": self.strategy, "decode_block_bucket": {"min": r.min, "step": r.step, "max": r.max}},
        }


def _block_bucket(pairs_of_bs: Sequence[int], need: int) -> int | None:
    return next((b for b in pairs_of_bs if b >= need), None)


def evaluate_hpu(
    batch_buckets: Sequence[int],
    block_buckets: Sequence[int],
    steps: StepDistribution,
    step_ms: PlaneCost,
    eager_ms: PlaneCost,
    max_blocks_per_seq: int,
    max_blocks_total: int | None,
) -> tuple[float, float, float, int]:
    """(expected ms, padded rows, padded blocks, buckets) of a bucket configuration over the steps."""
    pairs = decode_buckets(sorted(batch_buckets), sorted(block_buckets), max_blocks_per_seq, max_blocks_total)
    by_bs: dict[int, list[int]] = {}
    for bs, blocks in pairs:
        by_bs.setdefault(bs, []).append(blocks)
    sizes = sorted(by_bs)
    expected = rows = blocks_padded = 0.0
    for (n, k), p in steps.items():
        bs = next((s for s in sizes if s >= n), None)
        bucket = _block_bucket(by_bs[bs], k + bs - n) if bs is not None else None
        if bs is None or bucket is None:
            expected += p * eager_ms(n, k)
            continue
        expected += p * step_ms(bs, bucket)
        rows += p * (bs - n)
        blocks_padded += p * (bucket - k)
    return expected, rows, blocks_padded, len(pairs)


def propose_hpu_buckets(
    steps: StepDistribution,
    step_ms: PlaneCost,
    eager_ms: PlaneCost,
    batch_candidates: Sequence[int],
    block_steps: Sequence[int],
    max_blocks_per_seq: int,
    max_blocks_total: int | None,
    max_buckets: int | None = None,
    warmup_s_per_bucket: float = 0.0,
    warmup_budget_s: float | None = None,
    strategies: Sequence[str] = ("linear", "exponential"),
) -> HpuProposal:
    """The batch buckets and block range of least expected step time whose warm-up fits the budget."""
    batch_candidates = sorted(set(batch_candidates))
    top_blocks = max((k for _, k in steps), default=1)  # the block range ends at the most any step needs
    if max_blocks_total is not None:
        top_blocks = min(top_blocks, max_blocks_total)
    best: HpuProposal | None = None
    for strategy in strategies:
        for step in sorted(set(block_steps)):
            block_range = BucketRange(min=min(step, top_blocks), step=step, max=max(top_blocks, step))
            block_buckets = make_buckets(block_range, strategy)
            proposal = _best_batch_buckets(
                steps,
                step_ms,
                eager_ms,
                batch_candidates,
                block_buckets,
                block_range,
                strategy,
                max_blocks_per_seq,
                max_blocks_total,
                max_buckets,
                warmup_s_per_bucket,
                warmup_budget_s,
            )
            if proposal is not None and (
                best is None or (proposal.expected_ms, proposal.buckets) < (best.expected_ms, best.buckets)
            ):
                best = proposal
    if best is None:
        raise ValueError("no bucket configuration fits the warm-up budget")
    return best


def _best_batch_buckets(
    steps: StepDistribution,
    step_ms: PlaneCost,
    eager_ms: PlaneCost,
    candidates: list[int],
    block_buckets: list[int],
    block_range: BucketRange,
    strategy: str,
    max_blocks_per_seq: int,
    max_blocks_total: int | None,
    max_buckets: int | None,
    warmup_s_per_bucket: float,
    warmup_budget_s: float | None,
) -> HpuProposal | None:
    """For one block list: each batch bucket's cost for every batch it would serve, then the DP."""
    costs, per_bs = [], []
    for c in candidates:
        blocks = [b for _, b in decode_buckets([c], block_buckets, max_blocks_per_seq, max_blocks_total)]
        per_bs.append(sorted(blocks))
        costs.append(SizeCost(c, replay_ms=0.0, capture_s=len(blocks) * warmup_s_per_bucket, graphs=len(blocks)))
    rows_of = sorted({n for n, _ in steps})
    # served[i][n]: expected ms of the steps of n rows if batch bucket i serves them (eager where no block fits).
    served = [dict.fromkeys(rows_of, 0.0) for _ in candidates]
    eager_by_n = dict.fromkeys(rows_of, 0.0)
    for (n, k), p in steps.items():
        eager_by_n[n] += p * eager_ms(n, k)
        for i, c in enumerate(candidates):
            if c < n:
                continue
            bucket = _block_bucket(per_bs[i], k + c - n)
            served[i][n] += p * (step_ms(c, bucket) if bucket is not None else eager_ms(n, k))
    eager_total = sum(eager_by_n.values())

    def interval_ms(j: int, i: int) -> float:
        low = candidates[j] if j >= 0 else 0
        return sum(ms for n, ms in served[i].items() if low < n <= candidates[i])

    def tail_ms(j: int) -> float:
        low = candidates[j] if j >= 0 else 0
        return sum(ms for n, ms in eager_by_n.items() if n > low) if j >= 0 else eager_total

    budget = Budget(capture_s=warmup_budget_s, max_graphs=max_buckets)
    try:
        chosen = pareto_select(costs, interval_ms, tail_ms, budget)
    except ValueError:
        return None
    if not chosen:
        return None
    batch_buckets = [candidates[i] for i in chosen]
    expected, rows, blocks, buckets = evaluate_hpu(
        batch_buckets, block_buckets, steps, step_ms, eager_ms, max_blocks_per_seq, max_blocks_total
    )
    return HpuProposal(
        tuple(batch_buckets), block_range, strategy, tuple(block_buckets), buckets, expected, rows, blocks
    )
