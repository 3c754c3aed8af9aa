"""Replay a batch-size workload through Engine.step with two sets of capture sizes (tuned, default):
padding waste and decode step time of each, measured on the same engine, batch after batch.

Decode steps are drawn from the distribution (seeded); for each batch size drawn, in ascending order, the
engine holds exactly that many running requests (new ones prefilled on top of those already running)
and each set's runner, swapped in as ModelRunner.graph_runner, times full engine steps back to back;
the two sets alternate at every size so that drift (context growth, clocks, other load) hits both
alike. The workload's figure is the per-step mean weighted by how often each size was drawn.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine.tuning.distribution import SizeDistribution
from engine.tuning.measure import steady_ms

if TYPE_CHECKING:
    from engine.engine import Engine
    from graphs.step_runner import DecodeGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class WorkloadResult:
    name: str
    sizes: list[int]
    steps: int  # decode steps drawn
    mean_step_ms: float  # full engine step, weighted by the draw
    padding_rows: float  # mean padded rows per step
    padded_fraction: float  # padded rows / rows the graphs computed
    eager_steps: int  # drawn steps above the largest size (no graph)
    step_ms: dict[int, float] = field(default_factory=dict)  # by batch size


def sample_steps(distribution: SizeDistribution, steps: int, seed: int, max_sizes: int) -> Counter[int]:
    """`steps` decode batch sizes drawn from the distribution; only the `max_sizes` most frequent distinct
    sizes kept (each costs a prefill and timed steps), with the draw renormalised onto them."""
    rng = random.Random(seed)
    sizes, weights = zip(*distribution.weights.items())
    drawn = Counter(rng.choices(sizes, weights=weights, k=steps))
    if len(drawn) > max_sizes:
        kept = dict(drawn.most_common(max_sizes))
        logger.warning(
            "workload: %d distinct batch sizes drawn; timing the %d most frequent (%d of %d steps)",
            len(drawn),
            max_sizes,
            sum(kept.values()),
            steps,
        )
        drawn = Counter(kept)
    return drawn


def workload_growth(levels: int, iters: int, sets: int) -> int:
    """Tokens the first requests grow by over a replay (every level: one warm and `iters`+2 timed steps per set)."""
    return levels * sets * (iters + 4) + 8


def _grow_to(
    engine: Engine, target: int, context: int, max_tokens: int, generator: torch.Generator, ids: list[str]
) -> None:
    """Add requests until `target` run, and step until every one of them is decoding."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = int(engine.model_config.vocab_size)
    while len(ids) < target:
        prompt = torch.randint(1, vocab, (context,), generator=generator).tolist()
        ids.append(engine.add_request(prompt, params))
    scheduler = engine.scheduler
    # A pool too small for the batch would retract and re-admit forever: bounded, with the reason.
    limit = 4 * target * (1 + context // max(1, scheduler.chunked_prefill_size or context)) + 64
    for _ in range(limit):
        if len(scheduler.running) >= target and not scheduler.waiting and scheduler.chunked is None:
            return
        engine.step()  # prefill steps (and decodes of the requests already running)
    raise RuntimeError(
        f"workload: {target} requests of {context} tokens never all ran ({len(scheduler.running)} "
        f"running, {len(scheduler.waiting)} waiting, {scheduler.num_retractions} retractions): KV pool too small"
    )


def replay_workload(
    engine: Engine,
    runners: Mapping[str, DecodeGraphRunner | None],
    distribution: SizeDistribution,
    steps: int,
    iters: int,
    context: int,
    seed: int = 0,
    max_sizes: int = 64,
) -> list[WorkloadResult]:
    """Each named runner's padding and mean engine step over the same drawn workload."""
    drawn = sample_steps(distribution, steps, seed, max_sizes)
    levels = sorted(drawn)
    sync = engine.platform.synchronize
    # Exactly what the first requests generate over the replay: the scheduler reserves KV for max_tokens, and
    # the pool the tuner sized (workload_growth) then holds every request to the end without retraction.
    max_tokens = min(workload_growth(len(levels), iters, len(runners)), max(1, engine.max_model_len - context - 1))
    generator = torch.Generator().manual_seed(seed)
    ids: list[str] = []
    step_ms: dict[str, dict[int, float]] = {name: {} for name in runners}
    saved = engine.runner.graph_runner
    bar = tqdm(total=len(levels) * len(runners), desc="workload replay", unit="size")
    try:
        for size in levels:
            bar.set_postfix_str(f"prefill to {size}")
            _grow_to(engine, size, context, max_tokens, generator, ids)
            for name, runner in runners.items():
                bar.set_postfix_str(f"{name} at {size}")
                engine.runner.graph_runner = runner
                retractions = engine.scheduler.num_retractions
                step_ms[name][size] = steady_ms(sync, engine.step, iters)
                if engine.scheduler.num_retractions != retractions or len(engine.scheduler.running) != size:
                    raise RuntimeError(
                        f"workload: the batch of {size} changed while timed (retractions: KV pool too "
                        "small); the timings would mix in prefill steps"
                    )
                bar.update()
    finally:
        bar.close()
        engine.runner.graph_runner = saved
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
        engine.check_kv_invariant()
    total = sum(drawn.values())
    results = []
    for name, runner in runners.items():
        padded = computed = eager = 0
        for size, count in drawn.items():
            if runner is not None and runner.fits(size):
                served = runner.padded_size(size)
                padded += count * (served - size)
                computed += count * served
            else:
                eager += count
        mean = sum(count * step_ms[name][size] for size, count in drawn.items()) / total
        sizes = list(runner.capture_sizes) if runner is not None else []
        results.append(
            WorkloadResult(
                name,
                sizes,
                total,
                mean,
                padded / total,
                padded / computed if computed else 0.0,
                eager,
                dict(sorted(step_ms[name].items())),
            )
        )
    return results
