"""HPU prefix buckets for `engine tune-capture --device hpu`: the hpu.prompt_ctx_bucket range of least expected
prefill time for steps with a cached prefix. Device-independent; tested on CPU; NEVER RUN ON GAUDI.

A prefill step whose prompt has a cached prefix (a prefix-cache hit, or a later chunk of a long prompt)
runs a 3-D bucket (rows, new tokens per row, context pages per row): the one `choose_prompt_ctx_bucket`
picks among the triples `HpuBucketConfig.prompt_ctx_triples` keeps (backends/hpu/prefill.py). Those
triples are the prompt rows x the prompt sequence buckets x the context buckets, cut to
`hpu.max_prompt_ctx_buckets` (the fewest padded first), and every one is compiled at warm-up. So the
context range trades padded context pages against buckets warmed, priced by a fit to prefill passes
measured on a Gaudi with a prefix:

    ms = a + b * rows*seq + c * rows*seq^2 + d * rows*seq*ctx_tokens
    "ctx_points": [[rows, seq, ctx_pages, ms], ...]   (at least four)

the prompt cost of engine/tuning/prompt.py plus the attention of each new token to its padded prefix
(backends/hpu/attention.py gathers ctx pages a row, masked past the prefix). Each step is priced as one
prompt (rows = 1): new tokens from the prompt-length distribution, the cached prefix from
--prefix-lengths (tokens; counted in pages, as the runner counts them), drawn independently, pairs that
would not fit max_model_len dropped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from backends.hpu.bucketing import BucketOverflowError, BucketRange, choose_prompt_ctx_bucket, prompt_ctx_buckets
from engine.tuning.distribution import SizeDistribution, load_distribution_file, parse_spec

CtxSteps = list[tuple[float, int, int]]  # (probability, new tokens, cached prefix pages) of one prefixed step


@dataclass(frozen=True)
class CtxCost:
    """Prefill ms of a bucket with a prefix: a + b*rows*seq + c*rows*seq^2 + d*rows*seq*ctx_tokens."""

    a: float
    b: float
    c: float
    d: float
    page_size: int

    @classmethod
    def fit(cls, points: Sequence[Sequence[float]], page_size: int) -> CtxCost:
        if len(points) < 4 or any(len(p) != 4 for p in points):
            raise ValueError(
                f"the cost table needs at least four ctx_points [rows, tokens_per_row, ctx_pages, ms] to "
                f"fit prefill time with a prefix (got {len(points)}); docs/tuning.md gives the form"
            )
        x = np.array([[1.0, r * s, r * s * s, r * s * c * page_size] for r, s, c, _ in points], dtype=float)
        y = np.array([ms for *_, ms in points], dtype=float)
        a, b, c, d = np.linalg.lstsq(x, y, rcond=None)[0]
        return cls(float(a), float(b), float(c), float(d), page_size)

    def __call__(self, rows: int, seq: int, ctx_pages: int) -> float:
        tokens = rows * seq
        return max(0.0, self.a + self.b * tokens + self.c * tokens * seq + self.d * tokens * ctx_pages * self.page_size)


def load_prefix_lengths(source: str, max_len: int) -> SizeDistribution:
    """--prefix-lengths: cached prefix tokens of the steps that have one, a JSON/CSV file or a spec like
    '512-2048:0.7,4096:0.3' (the forms --distribution takes); lengths above max_len counted at it."""
    found = load_distribution_file(source) if os.path.exists(source) else parse_spec(source)
    return found.clipped(max_len)


def ctx_steps(new_tokens: SizeDistribution, prefixes: SizeDistribution, page_size: int, max_model_len: int) -> CtxSteps:
    """Every (new tokens, prefix pages) pair with its probability, those that fit max_model_len, renormalised."""
    pages: dict[int, float] = {}
    for length, p in prefixes.weights.items():
        pages[-(-length // page_size)] = pages.get(-(-length // page_size), 0.0) + p
    pairs = [
        (pn * pc, n, k)
        for n, pn in new_tokens.weights.items()
        for k, pc in pages.items()
        if n + (k - 1) * page_size < max_model_len
    ]
    total = sum(p for p, _, _ in pairs)
    if total <= 0:
        raise ValueError("no prompt and prefix length pair fits max_model_len: check --prefix-lengths")
    return [(p / total, n, k) for p, n, k in pairs]


@dataclass(frozen=True)
class CtxEvaluation:
    ctx_range: BucketRange | None  # None: prefix buckets off (every prefixed step unpadded)
    triples: tuple[tuple[int, int, int], ...]
    expected_ms: float  # prefill ms per prefixed step
    padded_tokens: float  # per step: padded new tokens plus padded context tokens
    warmup_s: float
    covers: bool = True

    @property
    def buckets(self) -> int:
        return len(self.triples)

    def config(self) -> dict[str, dict[str, int]]:
        r = self.ctx_range
        assert r is not None, "no context range to write"
        return {"prompt_ctx_bucket": {"min": r.min, "step": r.step, "max": r.max}}


def evaluate_ctx(
    ctx_range: BucketRange | None,
    ctx: Sequence[int],
    bs_buckets: Sequence[int],
    seq_buckets: Sequence[int],
    page_size: int,
    max_model_len: int,
    max_num_batched_tokens: int | None,
    limit: int | None,
    steps: CtxSteps,
    cost: CtxCost,
    warmup_s_per_bucket: float,
) -> CtxEvaluation:
    """The triples the engine would warm for these context buckets (`ctx`, from `ctx_range`; prompt_ctx_buckets,
    cut to `limit`) and what the steps cost on them. A step that fits none would run unpadded (a new graph per
    shape on Gaudi), so buckets that leave one out do not cover."""
    triples = tuple(
        prompt_ctx_buckets(bs_buckets, seq_buckets, ctx, page_size, max_model_len, max_num_batched_tokens, limit)
    )
    warmup = len(triples) * warmup_s_per_bucket
    ms = padded = 0.0
    try:
        for p, n, k in steps:
            bs, seq, pages = choose_prompt_ctx_bucket(1, n, k, triples, page_size)
            ms += p * cost(bs, seq, pages)
            padded += p * (bs * seq - n + (pages - k) * page_size)
    except BucketOverflowError:
        return CtxEvaluation(ctx_range, triples, math.inf, math.inf, warmup, covers=False)
    return CtxEvaluation(ctx_range, triples, ms, padded, warmup)


def candidate_ctx_ranges(steps: CtxSteps, ctx_steps_pages: Sequence[int]) -> list[BucketRange]:
    """For each step (pages): the range ends at the longest prefix rounded up to the step and starts at the
    step or at a low quantile of the prefixes (no bucket below the shortest)."""
    by_pages: dict[int, float] = {}
    for p, _, k in steps:
        by_pages[k] = by_pages.get(k, 0.0) + p
    ordered = sorted(by_pages.items())
    top = ordered[-1][0]
    lows = set()
    for q in (0.0, 0.1, 0.25, 0.5):
        cumulative = 0.0
        for pages, p in ordered:
            cumulative += p
            if cumulative >= q - 1e-12:
                lows.add(pages)
                break
    ranges = set()
    for step in sorted(set(ctx_steps_pages)):
        high = max(step, math.ceil(top / step) * step)
        for low in lows | {step}:
            ranges.add(BucketRange(min(low, high), step, high))
    return sorted(ranges, key=lambda r: (r.step, r.min, r.max))


@dataclass(frozen=True)
class CtxProposal:
    chosen: CtxEvaluation
    current: CtxEvaluation
    candidates: tuple[CtxEvaluation, ...]


def propose_ctx_buckets(
    steps: CtxSteps,
    current: CtxEvaluation,
    evaluate: Callable[[BucketRange], CtxEvaluation],
    ctx_steps_pages: Sequence[int],
) -> CtxProposal:
    """The context range of least expected ms per prefixed step that covers every step (the buckets warmed
    are bounded by max_prompt_ctx_buckets inside `evaluate`); fewer padded tokens, then fewer buckets, break
    ties. `evaluate(range) -> CtxEvaluation` prices one range with everything else fixed."""
    priced = [evaluate(r) for r in candidate_ctx_ranges(steps, ctx_steps_pages)]
    fitting = [e for e in priced if e.covers]
    if not fitting:
        raise ValueError(
            "no context bucket range covers the prefixes within hpu.max_prompt_ctx_buckets; raise "
            "--max-prompt-ctx-buckets or add --hpu-ctx-steps"
        )
    chosen = min(fitting, key=lambda e: (e.expected_ms, e.padded_tokens, e.buckets))
    return CtxProposal(chosen, current, tuple(priced))


def ctx_table(proposal: CtxProposal, limit: int = 12) -> str:
    head = (
        f"{'':<9} {'prompt_ctx min/step/max':>24} {'buckets':>8} {'pad tok/step':>13} {'ms/step':>10} {'warm-up s':>10}"
    )
    shown = sorted(proposal.candidates, key=lambda e: (not e.covers, e.expected_ms, e.padded_tokens, e.buckets))[:limit]
    lines = [head, "-" * len(head)]
    for mark, e in [("current", proposal.current)] + [
        ("*" if e == proposal.chosen else ("" if e.covers else "uncovered"), e) for e in shown
    ]:
        r = e.ctx_range
        text = f"{r.min}/{r.step}/{r.max}" if r is not None else "off"
        lines.append(
            f"{mark:<9} {text:>24} {e.buckets:>8} {e.padded_tokens:>13.1f} {e.expected_ms:>10.3f} {e.warmup_s:>10.1f}"
        )
    return "\n".join(lines)
