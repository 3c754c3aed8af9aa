"""Which decode sizes to capture: expected step time under a batch-size distribution, and the subset of the
measured candidates that minimises it within memory, capture-time and graph-count budgets.

A batch of b replays the smallest captured size s >= b (engine/capture_sizes.py), so it costs replay(s): the
replay of its own size plus the rows padded from b to s. A batch above the largest captured size runs
eagerly (ModelRunner: `runner.fits(b)` is false) and costs eager(b). The expected decode step time

    E(S) = sum_b p(b) * (replay(smallest s in S with s >= b)  if b <= max S  else  eager(b))

is therefore "replay time plus padding waste" (and eager time past the top), in milliseconds. It splits
into intervals between consecutive chosen sizes, so the best subset is a dynamic programme over the
sorted candidates; each label carries the memory, capture seconds and graphs spent so far, and labels
another label beats on cost and on every budgeted resource are dropped (a Pareto front per candidate).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.capture_sizes import default_capture_sizes, smallest_bucket_at_least
from engine.tuning.distribution import SizeDistribution

DISTRIBUTION_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def candidate_sizes(defaults: list[int], distribution: SizeDistribution, max_size: int) -> list[int]:
    """The default sizes, the default grid (dense to 8, then every 8) and the sizes at the distribution's
    quantiles (so a skewed distribution brings candidates where its mass is)."""
    sizes = set(defaults) | set(default_capture_sizes(max_size))
    cumulative, quantiles = 0.0, list(DISTRIBUTION_QUANTILES)
    for size, p in sorted(distribution.weights.items()):
        cumulative += p
        while quantiles and cumulative >= quantiles[0] - 1e-12:
            sizes.add(size)
            quantiles.pop(0)
    return sorted(s for s in sizes if 1 <= s <= max_size)


@dataclass(frozen=True)
class SizeCost:
    """What capturing one size costs and what its replay takes."""

    size: int
    replay_ms: float  # one replay of this size's graph (steady state, back to back)
    memory_mib: float = 0.0  # device memory its capture keeps (measured alone: an upper bound in a shared pool)
    capture_s: float = 0.0  # seconds its capture adds to start-up
    graphs: int = 1  # graphs it counts against a graph budget (NPU: 1; an HPU batch bucket: its block buckets)
    measured: bool = True  # False: interpolated between measured neighbours


@dataclass(frozen=True)
class Budget:
    memory_mib: float | None = None
    capture_s: float | None = None
    max_graphs: int | None = None
    cover: int | None = None  # the largest chosen size must be at least this (None: whatever is cheapest)
    # May the answer be "capture nothing" (every batch eager)? The engine always captures something unless
    # graphs are disabled, so the tuner asks for the best non-empty set and reports eager-only beside it.
    allow_empty: bool = True

    def limits(self) -> tuple[float, float, float]:
        inf = math.inf
        return (
            inf if self.memory_mib is None else self.memory_mib,
            inf if self.capture_s is None else self.capture_s,
            inf if self.max_graphs is None else float(self.max_graphs),
        )


def _interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points; beyond the ends the nearest segment's slope continues
    (clamped at zero), and a single point is a constant."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    lo = min(max(i - 1, 0), len(points) - 2)
    (x0, y0), (x1, y1) = points[lo], points[lo + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class CostModel:
    """Measured candidates plus eager step time by batch size (probed at a few sizes, linear between).

    fixed_capture_s / fixed_memory_mib: paid once whenever anything is captured (CUDA's compile of the
    step, shared by every size). memory_mib_per_top_row: memory per row of the largest captured size
    (CUDA's one static logits buffer, sized by it).

    shared_pool: the sizes are captured into one memory pool, largest first (CUDA/HIP graphs), so a set
    holds about the pool of its largest size (each SizeCost.memory_mib is a size captured alone) plus a
    graph's own overhead for each other size, bounded by the smallest candidate's whole pool. Otherwise
    (CPU compiled entries: code and buffers per size) the sizes' memory adds up."""

    costs: Sequence[SizeCost]
    eager_points: Mapping[int, float]
    fixed_capture_s: float = 0.0
    fixed_memory_mib: float = 0.0
    memory_mib_per_top_row: float = 0.0
    shared_pool: bool = False
    by_size: dict[int, SizeCost] = field(init=False)

    def __post_init__(self) -> None:
        if not self.costs:
            raise ValueError("no measured candidate sizes")
        if not self.eager_points:
            raise ValueError("no eager step times")
        self.by_size = {c.size: c for c in self.costs}
        self._sizes = sorted(self.by_size)
        self._eager = sorted((int(b), float(ms)) for b, ms in self.eager_points.items())

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def per_graph_mib(self) -> float:
        """Shared pool: what each size but the largest adds (the smallest candidate's pool bounds a graph's own)."""
        return self.by_size[self._sizes[0]].memory_mib

    def size_memory_mib(self, cost: SizeCost) -> float:
        """What one size adds to a set whatever the set's largest size is."""
        return min(cost.memory_mib, self.per_graph_mib) if self.shared_pool else cost.memory_mib

    def top_memory_mib(self, cost: SizeCost) -> float:
        """What a set pays on top when this size is its largest: its pool (shared) and its logits buffer."""
        pool = cost.memory_mib - self.size_memory_mib(cost) if self.shared_pool else 0.0
        return pool + self.memory_mib_per_top_row * cost.size

    def set_memory_mib(self, costs: Sequence[SizeCost]) -> float:
        if not costs:
            return 0.0
        top = max(costs, key=lambda c: c.size)
        return self.fixed_memory_mib + sum(self.size_memory_mib(c) for c in costs) + self.top_memory_mib(top)

    def eager_ms(self, batch: int) -> float:
        return _interpolate(self._eager, batch)

    def cost_of(self, size: int) -> SizeCost:
        """The measured cost, or one interpolated between the measured neighbours (measured=False)."""
        if size in self.by_size:
            return self.by_size[size]
        fields_ = {}
        for name in ("replay_ms", "memory_mib", "capture_s"):
            fields_[name] = _interpolate([(s, getattr(self.by_size[s], name)) for s in self._sizes], size)
        return SizeCost(size, measured=False, **fields_)

    def exact_ms(self, batch: int) -> float:
        """What a graph of exactly this batch would replay in (interpolated): the padding-free reference."""
        return self.cost_of(batch).replay_ms


@dataclass(frozen=True)
class Evaluation:
    """A set of capture sizes under a distribution: expected cost per decode step and what it spends."""

    sizes: tuple[int, ...]
    expected_ms: float  # mean decode step (replay of the padded size, or eager above the largest)
    padding_ms: float  # of which: time of padded rows (replay(s(b)) - replay of exactly b)
    padding_rows: float  # mean padded rows per decode step
    padded_fraction: float  # padded rows / rows the replayed graphs computed
    eager_fraction: float  # share of steps above the largest size (run eagerly)
    memory_mib: float
    capture_s: float
    graphs: int
    interpolated: tuple[int, ...] = ()  # sizes whose costs were interpolated, not measured

    def as_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def evaluate(sizes: Sequence[int], distribution: SizeDistribution, model: CostModel) -> Evaluation:
    chosen = sorted({int(s) for s in sizes})
    costs = [model.cost_of(s) for s in chosen]
    replay = {c.size: c.replay_ms for c in costs}
    expected = padding_ms = padding_rows = computed = eager_mass = 0.0
    for batch, p in distribution.weights.items():
        served = smallest_bucket_at_least(chosen, batch) if chosen else None
        if served is None:
            expected += p * model.eager_ms(batch)
            eager_mass += p
            continue
        expected += p * replay[served]
        padding_ms += p * max(0.0, replay[served] - model.exact_ms(batch))
        padding_rows += p * (served - batch)
        computed += p * served
    anything = bool(chosen)
    return Evaluation(
        sizes=tuple(chosen),
        expected_ms=expected,
        padding_ms=padding_ms,
        padding_rows=padding_rows,
        padded_fraction=padding_rows / computed if computed else 0.0,
        eager_fraction=eager_mass,
        memory_mib=model.set_memory_mib(costs),
        capture_s=sum(c.capture_s for c in costs) + (model.fixed_capture_s if anything else 0.0),
        graphs=sum(c.graphs for c in costs),
        interpolated=tuple(c.size for c in costs if not c.measured),
    )


# ---- the dynamic programme ---------------------------------------------------------------------------


GRID = 1000  # budgeted resources compare in steps of budget / GRID when pruning (0.1% of each budget)


@dataclass(frozen=True)
class _Label:
    cost: float  # expected ms of the batches served so far (those <= this label's last size)
    resources: tuple[float, float, float]  # memory MiB, capture s, graphs
    index: int  # candidate index of the last chosen size (-1: none yet)
    parent: _Label | None


def _prune(labels: list[_Label], tracked: list[int], grain: list[float]) -> list[_Label]:
    """Drop every label another one matches or beats on cost and on each budgeted resource (compared on a
    grid of 1/GRID of each budget, so the front stays small; kept labels keep their exact figures).

    Labels go in order of cost, so a label survives only if no cheaper one has less of every resource:
    one running minimum for one budget, a staircase (numpy) for two, a scan for three."""
    labels.sort(key=lambda lab: (lab.cost, *(lab.resources[d] for d in tracked)))
    if not tracked:
        return labels[:1]
    keys = [tuple(int(lab.resources[d] / grain[d] + 1e-9) for d in tracked) for lab in labels]
    kept: list[_Label] = []
    if len(tracked) == 1:
        lowest = math.inf
        for lab, (key,) in zip(labels, keys):
            if key < lowest:
                kept.append(lab)
                lowest = key
        return kept
    if len(tracked) == 2:
        # stair[a]: the least second key among kept labels whose first key is <= a.
        stair = np.full(GRID + 2, np.iinfo(np.int64).max, dtype=np.int64)
        for lab, (a, b) in zip(labels, keys):
            a = min(a, GRID + 1)
            if stair[a] <= b:
                continue
            kept.append(lab)
            np.minimum(stair[a:], b, out=stair[a:])
        return kept
    seen: list[tuple[int, ...]] = []
    for lab, key in zip(labels, keys):
        if not any(all(k <= mine for k, mine in zip(other, key)) for other in seen):
            kept.append(lab)
            seen.append(key)
    return kept


def pareto_select(
    candidates: Sequence[SizeCost],
    interval_ms: Callable[[int, int], float],
    tail_ms: Callable[[int], float],
    budget: Budget,
    fixed: tuple[float, float, float] = (0.0, 0.0, 0.0),
    top_memory: Callable[[int], float] = lambda i: 0.0,
) -> list[int]:
    """Indices (into sorted candidates) of the subset minimising the total cost within the budget.

    interval_ms(j, i): expected ms of the batches in (size_j, size_i] served by size i (j = -1: from 1).
    tail_ms(j): expected ms of every batch above size_j (j = -1: all of them), which no graph serves.
    fixed: (memory, capture s, graphs) paid once if anything is captured; top_memory(i): memory paid when
    candidate i is the largest chosen (checked when a set ends there: every label of one candidate's front
    pays the same, so pruning is unaffected).
    Ties go to fewer graphs, then less memory, then less capture time.
    """
    limits = budget.limits()
    tracked = [d for d in range(3) if math.isfinite(limits[d])]
    grain = [max(limit / GRID, 1e-12) if math.isfinite(limit) else 1.0 for limit in limits]
    root = _Label(0.0, (0.0, 0.0, 0.0), -1, None)
    fronts: list[list[_Label]] = []
    for i, cand in enumerate(candidates):
        spend = (cand.memory_mib, cand.capture_s, float(cand.graphs))
        grown: list[_Label] = []
        for j in range(-1, i):
            step = interval_ms(j, i)
            for lab in fronts[j] if j >= 0 else [root]:
                first = fixed if lab.parent is None and lab.index == -1 else (0.0, 0.0, 0.0)
                res = tuple(lab.resources[d] + spend[d] + first[d] for d in range(3))
                if any(res[d] > limits[d] * (1 + 1e-9) for d in range(3)):
                    continue
                grown.append(_Label(lab.cost + step, res, i, lab))  # type: ignore[arg-type]
        fronts.append(_prune(grown, tracked, grain))
    finals: list[tuple[tuple[float, ...], _Label]] = []
    if budget.cover is None and budget.allow_empty:
        finals.append(((round(tail_ms(-1), 9), 0.0, 0.0, 0.0), root))
    for i, front in enumerate(fronts):
        if budget.cover is not None and candidates[i].size < budget.cover:
            continue
        for lab in front:
            if lab.resources[0] + top_memory(i) > limits[0] * (1 + 1e-9):
                continue
            total = lab.cost + tail_ms(i)
            finals.append(((round(total, 9), lab.resources[2], lab.resources[0], lab.resources[1]), lab))
    if not finals:
        raise ValueError(f"no candidate set fits the budget {budget} (the cheapest single size does not)")
    best = min(finals, key=lambda item: item[0])[1]
    chosen: list[int] = []
    node: _Label | None = best
    while node is not None and node.index >= 0:
        chosen.append(node.index)
        node = node.parent
    return sorted(chosen)


def select_sizes(distribution: SizeDistribution, model: CostModel, budget: Budget) -> Evaluation:
    """The measured candidates that minimise the expected decode step within the budget."""
    measured = [model.by_size[s] for s in model.sizes]
    sizes = [c.size for c in measured]
    # The DP spends each size's own share as it goes; the largest's pool and logits buffer when a set ends.
    candidates = [dataclasses.replace(c, memory_mib=model.size_memory_mib(c)) for c in measured]
    mass = [0.0] * len(sizes)  # probability of batches <= sizes[i]
    eager_le = [0.0] * len(sizes)  # expected eager ms of batches <= sizes[i]
    eager_total = 0.0
    for batch, p in distribution.weights.items():
        ms = p * model.eager_ms(batch)
        eager_total += ms
        for i in range(bisect.bisect_left(sizes, batch), len(sizes)):
            mass[i] += p
            eager_le[i] += ms

    def interval_ms(j: int, i: int) -> float:
        return (mass[i] - (mass[j] if j >= 0 else 0.0)) * candidates[i].replay_ms

    def tail_ms(j: int) -> float:
        return eager_total - (eager_le[j] if j >= 0 else 0.0)

    fixed = (model.fixed_memory_mib, model.fixed_capture_s, 0.0)
    chosen = pareto_select(candidates, interval_ms, tail_ms, budget, fixed, lambda i: model.top_memory_mib(measured[i]))
    return evaluate([sizes[i] for i in chosen], distribution, model)
