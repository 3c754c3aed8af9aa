"""HPU prompt buckets for `engine tune-capture --device hpu`: the prompt_bs / prompt_seq ranges of least expected
prefill time for a prompt-length distribution. Device-independent; tested on CPU; NEVER RUN ON GAUDI.

A prefill step's prompts are grouped in order and each group is padded to the (rows, tokens per row) bucket
that `choose_prompt_bucket` picks (backends/hpu/prefill.group_prompts), so a prompt of length L costs the
bucket that function would pick, and pads it by bucket tokens - L. Every pair of the two lists (within
max_num_batched_tokens) is compiled at warm-up, so the budget is a number of prompt buckets (or their
warm-up seconds). The lists come from {min, step, max} ranges (the form configs/hpu.yaml and the
ENGINE_PROMPT_*_BUCKET_* variables take), so, as for the decode blocks (engine/tuning/buckets.py), the
proposal is a search over ranges, priced by a fit to a few prefill times measured on a Gaudi:

    "prompt_points": [[rows, tokens_per_row, ms], ...]   (at least three), "warmup_s_per_prompt_bucket": s
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.hpu.bucketing import BucketOverflowError, BucketRange, choose_prompt_bucket, make_buckets, prompt_buckets
from engine.tuning.distribution import (
    SizeDistribution,
    fetch_metrics,
    from_prometheus_text,
    load_distribution_file,
    parse_spec,
)

# The throughput benchmark's prompt lengths (engine/bench_throughput.py --input-len 256,768, drawn uniformly):
# the workload the engine's throughput figures come from, so the default tunes for what is measured.
DEFAULT_PROMPT_LENGTHS = (256, 768)
SAMPLED_STEPS = 256  # steps of several prompts drawn to price grouping (seeded: the same draw for every candidate)

Steps = list[tuple[float, tuple[int, ...]]]  # (probability, prompt lengths of one prefill step)


@dataclass(frozen=True)
class PromptCost:
    """Prefill milliseconds as a + b * rows*seq + c * rows*seq^2, least squares over measured (rows, seq, ms):
    the linear layers cost per token (rows*seq), the padded-prompt attention (backends/hpu/prompt_attention.py,
    a dense [rows, heads, seq, seq] softmax) per row and squared length, and a is the weight read of a pass."""

    a: float
    b: float
    c: float

    @classmethod
    def fit(cls, points: Sequence[Sequence[float]]) -> PromptCost:
        if len(points) < 3 or any(len(p) != 3 for p in points):
            raise ValueError(
                f"the cost table needs at least three prompt_points [rows, tokens_per_row, ms] to fit "
                f"prefill time (got {len(points)}); docs/tuning.md gives the form"
            )
        x = np.array([[1.0, rows * seq, rows * seq * seq] for rows, seq, _ in points], dtype=float)
        y = np.array([ms for _, _, ms in points], dtype=float)
        a, b, c = np.linalg.lstsq(x, y, rcond=None)[0]
        return cls(float(a), float(b), float(c))

    def __call__(self, rows: int, seq: int) -> float:
        return max(0.0, self.a + self.b * rows * seq + self.c * rows * seq * seq)


PROMPT_HISTOGRAM = "engine:request_prompt_tokens"  # a server's prompt lengths (engine/stats.py PROMPT_TOKEN_BOUNDS)


def load_prompt_lengths(
    source: str | None, max_len: int, metrics_url: str | None = None, api_key: str | None = None
) -> SizeDistribution:
    """--prompt-lengths: a JSON/CSV file (a list of observed lengths or length -> weight, as --distribution
    takes) or a spec like '256-768' or '100-200:0.8,2000:0.2'; without it, a server's /metrics prompt-length
    histogram (--metrics-url, the same scrape as the batch sizes'), else the default (uniform 256..768).
    Lengths above max_len are counted at max_len (no prompt is longer than the engine takes)."""
    if source and os.path.exists(source):
        found = load_distribution_file(source)
    elif source:
        found = parse_spec(source)
    elif metrics_url:
        found = from_prometheus_text(
            fetch_metrics(metrics_url, api_key), source=f"{metrics_url} prompt lengths", name=PROMPT_HISTOGRAM
        )
    else:
        low, high = DEFAULT_PROMPT_LENGTHS
        found = SizeDistribution(
            dict.fromkeys(range(low, high + 1), 1.0 / (high - low + 1)),
            f"default: uniform {low}..{high} tokens (the throughput benchmark's --input-len)",
        )
    return found.clipped(max_len)


def describe_lengths(lengths: SizeDistribution) -> str:
    """SizeDistribution.summary speaks of batches; this speaks of prompt tokens."""
    low, high = min(lengths.weights), max(lengths.weights)
    return f"{lengths.source}: prompts of {low}..{high} tokens, mean {lengths.mean:.0f}"


def prompt_steps(lengths: SizeDistribution, prompts_per_step: int, seed: int = 0) -> Steps:
    """The prefill steps to price: one prompt each, exactly (every length with its probability); or, with
    several prompts a step, a seeded draw of SAMPLED_STEPS steps (grouping depends on their order)."""
    if prompts_per_step < 1:
        raise ValueError(f"prompts per prefill step must be >= 1, got {prompts_per_step}")
    if prompts_per_step == 1:
        return [(p, (n,)) for n, p in lengths.weights.items()]
    rng = random.Random(seed)
    sizes, weights = list(lengths.weights), list(lengths.weights.values())
    return [(1.0 / SAMPLED_STEPS, tuple(rng.choices(sizes, weights, k=prompts_per_step))) for _ in range(SAMPLED_STEPS)]


@dataclass(frozen=True)
class PromptEvaluation:
    bs_range: BucketRange
    seq_range: BucketRange
    pairs: tuple[tuple[int, int], ...]  # the (rows, seq) buckets warmed up
    expected_ms: float  # prefill milliseconds per prompt
    padded_tokens: float  # per prompt, padded rows included
    warmup_s: float
    covers: bool = True  # every prompt of the distribution has a bucket

    @property
    def buckets(self) -> int:
        return len(self.pairs)

    def config(self) -> dict[str, dict[str, int]]:
        """The keys of configs/hpu.yaml's `hpu:` section."""
        return {
            f"prompt_{name}_bucket": {"min": r.min, "step": r.step, "max": r.max}
            for name, r in (("bs", self.bs_range), ("seq", self.seq_range))
        }


def _group(lengths: tuple[int, ...], pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(bucket rows, bucket seq, real tokens) of each padded pass, as backends/hpu/prefill.group_prompts
    forms them; one prompt alone is the common case and needs no grouping."""
    if len(lengths) == 1:
        return [(*choose_prompt_bucket(1, lengths[0], pairs), lengths[0])]
    from backends.hpu.prefill import group_prompts

    return [(bs, seq, sum(lengths[i] for i in idx)) for idx, (bs, seq) in group_prompts(list(lengths), pairs)]


def price_pairs(pairs: Sequence[tuple[int, int]], steps: Steps, cost: PromptCost) -> tuple[float, float] | None:
    """(expected ms, padded tokens) per prompt over the steps; None when a prompt fits no bucket (it would run
    unpadded: on Gaudi a new graph per shape, so such a configuration is no candidate)."""
    ms = padded = prompts = 0.0
    try:
        for p, lengths in steps:
            for bs, seq, real in _group(lengths, pairs):
                ms += p * cost(bs, seq)
                padded += p * (bs * seq - real)
            prompts += p * len(lengths)
    except BucketOverflowError:
        return None
    return ms / prompts, padded / prompts


def evaluate_pairs(
    bs_range: BucketRange,
    seq_range: BucketRange,
    pairs: Sequence[tuple[int, int]],
    steps: Steps,
    cost: PromptCost,
    warmup_s_per_bucket: float,
) -> PromptEvaluation:
    priced = price_pairs(pairs, steps, cost)
    warmup = len(pairs) * warmup_s_per_bucket
    if priced is None:
        return PromptEvaluation(bs_range, seq_range, tuple(pairs), math.inf, math.inf, warmup, covers=False)
    return PromptEvaluation(bs_range, seq_range, tuple(pairs), priced[0], priced[1], warmup)


def evaluate_prompt(
    bs_range: BucketRange,
    seq_range: BucketRange,
    strategy: str,
    max_num_batched_tokens: int | None,
    steps: Steps,
    cost: PromptCost,
    warmup_s_per_bucket: float,
) -> PromptEvaluation:
    """Expected prefill ms and padded tokens per prompt of the buckets these ranges generate."""
    pairs = prompt_buckets(make_buckets(bs_range, strategy), make_buckets(seq_range, strategy), max_num_batched_tokens)
    return evaluate_pairs(bs_range, seq_range, pairs, steps, cost, warmup_s_per_bucket)


def bs_range_up_to(top: int, strategy: str) -> BucketRange:
    """Rows 1, 2, 4, ..., top (top a power of two) in either strategy: linear doubles below its step, so the
    step is top; exponential spaces geometrically and rounds up to its step, so the step is 1."""
    return BucketRange(1, top if strategy == "linear" else 1, top)


def candidate_ranges(
    lengths: SizeDistribution,
    seq_steps: Sequence[int],
    strategy: str,
    max_rows: int,
    max_num_batched_tokens: int | None,
) -> list[tuple[BucketRange, BucketRange]]:
    """(prompt_bs, prompt_seq) ranges to price. Sequence: for each step, the range ends at the longest prompt
    rounded up to the step (a shorter one leaves prompts unbucketed, a longer one warms buckets no prompt
    takes) and starts at the step or at a low quantile of the lengths (no bucket below the shortest prompts).
    Rows: 1, 2, 4, ... up to max_rows, no further than max_num_batched_tokens holds at the shortest bucket."""
    top = max(lengths.weights)
    ordered = sorted(lengths.weights.items())
    quantiles = {_quantile(ordered, q) for q in (0.0, 0.1, 0.25, 0.5)}
    seq_ranges: set[BucketRange] = set()
    for step in sorted(set(seq_steps)):
        high = max(step, math.ceil(top / step) * step)
        if max_num_batched_tokens is not None and high > max_num_batched_tokens:
            high = top  # rounded up, a one-row bucket would exceed the token budget and be dropped
        for low in quantiles | {step}:
            seq_ranges.add(BucketRange(min(low, high), step, high))
    pairs = []
    for seq_range in sorted(seq_ranges, key=lambda r: (r.step, r.min)):
        rows_cap = (
            max_rows if max_num_batched_tokens is None else min(max_rows, max_num_batched_tokens // seq_range.min)
        )
        rows = 1
        while rows <= max(rows_cap, 1):
            pairs.append((bs_range_up_to(rows, strategy), seq_range))
            rows *= 2
    return pairs


def _quantile(ordered: Sequence[tuple[int, float]], q: float) -> int:
    """The smallest length with at least q of the mass at or below it."""
    cumulative = 0.0
    for length, p in ordered:
        cumulative += p
        if cumulative >= q - 1e-12:
            return length
    return ordered[-1][0]


@dataclass(frozen=True)
class PromptProposal:
    chosen: PromptEvaluation
    current: PromptEvaluation
    candidates: tuple[PromptEvaluation, ...]  # every candidate priced, the chosen one among them


def propose_prompt_buckets(
    lengths: SizeDistribution,
    steps: Steps,
    cost: PromptCost,
    current: PromptEvaluation,
    strategy: str,
    seq_steps: Sequence[int],
    max_rows: int,
    max_num_batched_tokens: int | None,
    warmup_s_per_bucket: float = 0.0,
    max_buckets: int | None = None,
    warmup_budget_s: float | None = None,
) -> PromptProposal:
    """The prompt ranges of least expected prefill ms per prompt within the budget; fewer padded tokens, then
    fewer buckets, break ties (padding is already in the ms through the bucket's cost, so the ms leads)."""
    priced = [
        evaluate_prompt(bs, seq, strategy, max_num_batched_tokens, steps, cost, warmup_s_per_bucket)
        for bs, seq in candidate_ranges(lengths, seq_steps, strategy, max_rows, max_num_batched_tokens)
    ]
    fitting = [e for e in priced if e.covers and _within(e, max_buckets, warmup_budget_s)]
    if not fitting:
        raise ValueError(
            f"no prompt bucket range covers the prompt lengths within {max_buckets} buckets / "
            f"{warmup_budget_s} s of warm-up; raise --max-prompt-buckets or add --hpu-prompt-seq-steps"
        )
    chosen = min(fitting, key=lambda e: (e.expected_ms, e.padded_tokens, e.buckets))
    return PromptProposal(chosen, current, tuple(priced))


def _within(e: PromptEvaluation, max_buckets: int | None, warmup_budget_s: float | None) -> bool:
    return (max_buckets is None or e.buckets <= max_buckets) and (
        warmup_budget_s is None or e.warmup_s <= warmup_budget_s
    )


def _range_text(r: BucketRange) -> str:
    return f"{r.min}/{r.step}/{r.max}"


def prompt_table(
    proposal: PromptProposal, max_buckets: int | None, warmup_budget_s: float | None, limit: int = 20
) -> str:
    """The candidates by expected ms (the best `limit` of those within budget, then the current ranges), the
    chosen one marked '*', the current one 'current', over-budget ones 'budget', unbucketed ones 'uncovered'."""
    head = (
        f"{'':<9} {'prompt_bs min/step/max':>23} {'prompt_seq min/step/max':>24} {'buckets':>8} "
        f"{'pad tok/prompt':>15} {'ms/prompt':>10} {'warm-up s':>10}"
    )
    within = sorted(
        (e for e in proposal.candidates if e.covers and _within(e, max_buckets, warmup_budget_s)),
        key=lambda e: (e.expected_ms, e.padded_tokens, e.buckets),
    )[:limit]
    rest = [e for e in proposal.candidates if e not in within]
    shown = within + sorted(rest, key=lambda e: e.expected_ms)[: max(0, limit // 4)]
    lines = [head, "-" * len(head)]
    for mark, e in [("current", proposal.current)] + [
        (_mark(e, proposal, max_buckets, warmup_budget_s), e) for e in shown
    ]:
        lines.append(
            f"{mark:<9} {_range_text(e.bs_range):>23} {_range_text(e.seq_range):>24} {e.buckets:>8} "
            f"{e.padded_tokens:>15.1f} {e.expected_ms:>10.3f} {e.warmup_s:>10.1f}"
        )
    return "\n".join(lines)


def _mark(e: PromptEvaluation, proposal: PromptProposal, max_buckets: int | None, warmup_budget_s: float | None) -> str:
    if e == proposal.chosen:
        return "*"
    if not e.covers:
        return "uncovered"
    return "" if _within(e, max_buckets, warmup_budget_s) else "budget"
