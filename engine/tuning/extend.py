"""`engine tune-capture --extend`: which token-count buckets of extend/mixed-step CUDA graphs to capture.

A prefill, chunk or mixed step of t tokens replays the smallest captured bucket b >= t (its tokens padded
to b, graphs/extend_graph_runner.py); past the largest bucket it runs unbucketed: the compiled
token-dynamic step (compile_extend) or the eager one. So the trade is the decode sizes' one with tokens for
rows, and the selection is the same programme (engine/tuning/select.py):

    E(S) = sum_t p(t) * (replay(smallest b in S, b >= t)  if t <= max S  else  unbucketed(t))

What is measured, with the engine's own pieces (a real Engine built with graphs off; the step function is
the one Engine._extend_graphs would capture):

- unbucketed(t) at every candidate and at the distribution's largest count: the step run back to back
  (steady state) over a batch of t tokens. The batch is prompts of --prompt-len tokens (the last shorter)
  on fresh pages with no cached prefix, so attention does a prompt's causal work, not a decode row's.
  These runs come first, so the compiled step's one compile is paid before any capture.
- per candidate bucket: an ExtendGraphRunner of that bucket alone (its own memory pool): capture seconds,
  graph memory (free device memory before/after) and the replay of the same batch padded to the bucket.
  In the engine the buckets share the decode graphs' pool, largest first, so a set's memory is about its
  largest bucket's pool (CostModel.shared_pool); --verify captures the chosen set as the engine does.

The answer may be "no buckets" (Budget.allow_empty): the engine runs fine without extend graphs, and on
the H200 the compiled step is already within a few percent of the GEMM rate at large token counts.
The file written carries `extend_capture_tokens` and the `compile_extend` it was measured with, in a block
of its own, so a decode tuning in the same file stays.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from engine.capture_sizes import parse_sizes
from engine.platform import CaptureKind
from engine.tuning.distribution import TOKENS_HISTOGRAM, SizeDistribution, load_distribution
from engine.tuning.measure import MeasureReport, SizeMeasurement, machine_info, steady_ms
from engine.tuning.output import print_tables, write_json, write_tuned_yaml
from engine.tuning.select import DISTRIBUTION_QUANTILES, Budget, Evaluation, evaluate, select_sizes

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.forward_batch import ForwardBatch
    from graphs.extend_graph_runner import StepFn

logger = logging.getLogger("engine.tune")

MIN_BUCKET = 16  # the smallest bucket candidate: below it a step is a handful of decode rows or one short prompt


def extend_candidates(defaults: Sequence[int], distribution: SizeDistribution, max_tokens: int) -> list[int]:
    """Powers of two from MIN_BUCKET, the current buckets, and the distribution's quantiles rounded up to a
    multiple of MIN_BUCKET (so a skewed distribution brings buckets where its mass is); all <= max_tokens,
    which is always one (the largest step the scheduler forms)."""
    sizes = {min(int(d), max_tokens) for d in defaults}
    size = MIN_BUCKET
    while size < max_tokens:
        sizes.add(size)
        size *= 2
    sizes.add(max_tokens)
    cumulative, quantiles = 0.0, list(DISTRIBUTION_QUANTILES)
    for tokens, p in sorted(distribution.weights.items()):
        cumulative += p
        while quantiles and cumulative >= quantiles[0] - 1e-12:
            sizes.add(min(max_tokens, -(-tokens // MIN_BUCKET) * MIN_BUCKET))
            quantiles.pop(0)
    return sorted(s for s in sizes if 1 <= s <= max_tokens)


def prompt_batch(engine: Engine, tokens: int, prompt_len: int, seed: int = 0) -> ForwardBatch:
    """An extend batch of `tokens` tokens: prompts of prompt_len (the last shorter) with no cached prefix,
    each on fresh pages of the engine's pool (page 0 is the padding page, never used)."""
    from engine.forward_batch import build_forward_batch
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    page = engine.kv_pool.page_size
    lens = [prompt_len] * (tokens // prompt_len) + ([tokens % prompt_len] if tokens % prompt_len else [])
    pages_needed = sum(-(-n // page) for n in lens)
    if pages_needed >= engine.kv_manager.total_pages:
        raise ValueError(
            f"a {tokens}-token batch needs {pages_needed} pages; the pool has {engine.kv_manager.total_pages}"
        )
    generator = torch.Generator().manual_seed(seed)
    vocab = int(engine.model_config.vocab_size)
    requests, pages_of, next_page = [], {}, 1
    for i, n in enumerate(lens):
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        request = Request(f"tune-extend-{i}", ids, SamplingParams())
        count = -(-n // page)
        pages_of[request.request_id] = list(range(next_page, next_page + count))
        next_page += count
        requests.append(request)
    return build_forward_batch(
        requests, pages_of, page, engine.device, engine.platform.slot_index_dtype, extend_lens=lens
    )


def extend_step_fn(engine: Engine, compiled: bool) -> StepFn:
    """What Engine._extend_graphs captures: the compiled token-dynamic step, or the eager forward."""
    from graphs.extend_graph_runner import eager_extend_step

    if compiled:
        from graphs.compiled_extend import CompiledExtendStep

        return CompiledExtendStep(engine.model, engine.kv_pool.caches)
    return eager_extend_step(engine.model, engine.kv_pool.caches)


def _runner(engine: Engine, step: StepFn, buckets: Sequence[int]) -> Any:
    from graphs.extend_graph_runner import ExtendGraphRunner

    max_pages = -(-engine.max_model_len // engine.kv_pool.page_size)
    return ExtendGraphRunner(
        step,
        list(buckets),
        int(engine.config.max_num_seqs),
        max_pages,
        engine.kv_pool.page_size,
        engine.device,
        engine.platform.slot_index_dtype,
    )


def _release(runner: Any) -> None:
    """A measured runner's graphs and their outputs go, and the pool's memory returns to the device, before
    the next one is captured (its static buffers go with the caller's last reference)."""
    runner.graphs.clear()
    runner.outputs.clear()
    gc.collect()
    torch.cuda.empty_cache()


def measure_extend_buckets(
    engine: Engine,
    step: StepFn,
    candidates: Sequence[int],
    probe_tokens: Sequence[int],
    prompt_len: int,
    iters: int,
) -> MeasureReport:
    """Unbucketed step, capture seconds, graph memory and replay for each candidate (module docstring)."""
    if engine.platform.capture_settings().kind is not CaptureKind.CUDA_GRAPH:
        raise ValueError(
            f"extend graphs are CUDA/HIP graphs; {engine.platform.name} has none to measure "
            "(pass --cost-table with figures measured on a GPU)"
        )
    start = time.perf_counter()
    sync = engine.platform.synchronize
    buckets = sorted({int(c) for c in candidates})
    probes = sorted({int(t) for t in probe_tokens} | set(buckets))
    bar = tqdm(total=len(probes) + 2 * len(buckets), desc="tune-capture --extend", unit="step")
    unbucketed: dict[int, float] = {}
    with torch.no_grad():
        for tokens in probes:
            bar.set_postfix_str(f"unbucketed {tokens}")
            batch = prompt_batch(engine, tokens, prompt_len)
            unbucketed[tokens] = steady_ms(sync, lambda b=batch: step(b.input_ids, b.positions, b.meta), iters)
            bar.update()
    measured: list[SizeMeasurement] = []
    for bucket in sorted(buckets, reverse=True):  # largest first, as the engine captures them
        bar.set_postfix_str(f"capture {bucket}")
        runner = _runner(engine, step, [bucket])
        runner.capture()  # a pool of its own: this bucket's memory alone
        bar.update()
        bar.set_postfix_str(f"replay {bucket}")
        batch = prompt_batch(engine, bucket, prompt_len)
        with torch.no_grad():
            replay = steady_ms(sync, lambda b=batch, r=runner: r.replay(b), iters)
        measured.append(
            SizeMeasurement(
                size=bucket,
                replay_ms=replay,
                eager_ms=unbucketed[bucket],
                capture_s=runner.capture_seconds,
                first_capture_s=runner.capture_seconds,
                memory_mib=runner.graph_memory_bytes / 2**20,
                memory_source="device",
            )
        )
        _release(runner)
        bar.update()
    bar.close()
    return MeasureReport(
        sorted(measured, key=lambda m: m.size),
        unbucketed,
        0.0,
        0.0,
        0.0,
        CaptureKind.CUDA_GRAPH,
        prompt_len,
        iters,
        machine_info(engine),
        time.perf_counter() - start,
    )


def _measurement_engine(args: argparse.Namespace, max_tokens: int, prompt_len: int) -> Engine:
    """A real engine with graphs off and a KV pool for the largest measured batch (and a full context)."""
    from backends import get_platform
    from engine.cli import engine_config_from_args
    from engine.engine import Engine

    config = engine_config_from_args(args, disable_graphs=True, warmup=False)
    resolved = config.resolve(get_platform(args.device))
    page = int(resolved.page_size)
    prompts = -(-max_tokens // prompt_len)
    config.kv_cache_tokens = max(max_tokens + 2 * page * (prompts + 1), int(resolved.max_model_len))
    return Engine(config)


def _verify(engine: Engine, step: StepFn, sets: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Each non-empty set captured as the engine captures it (one runner, one pool): real seconds and memory.
    `step` is the measured one, already compiled."""
    figures = {}
    for name, buckets in sets.items():
        if not buckets:
            continue
        runner = _runner(engine, step, buckets)
        runner.capture()
        figures[name] = {
            "capture_s": runner.capture_seconds,
            "memory_mib": runner.graph_memory_bytes / 2**20,
            "memory_source": "device",
        }
        _release(runner)
    return figures


def _budget(args: argparse.Namespace, default: Evaluation) -> Budget:
    """The given budgets; else the current buckets' cost when there are some, else none."""

    def pick(given: float | None, current: float) -> float | None:
        value = given if given is not None else (current if default.sizes else math.inf)
        return None if math.isinf(value) else max(value, 1e-6)

    return Budget(
        memory_mib=pick(args.memory_budget_mib, default.memory_mib),
        capture_s=pick(args.capture_time_budget_s, default.capture_s),
        max_graphs=args.max_graphs,
        cover=args.cover,
        allow_empty=True,
    )


def _header(info: dict[str, Any], tuned: Evaluation, default: Evaluation) -> list[str]:
    from engine.tuning.output import describe

    gain = 100 * (default.expected_ms - tuned.expected_ms) / default.expected_ms if default.expected_ms else 0.0
    step = "the compiled token-dynamic step" if info["compiled"] else "the eager step"
    lines = [
        f"Extend-graph token buckets tuned by `engine tune-capture --extend` on {info['date']} for {info['model']} "
        f"({info['dtype']}, page size {info['page_size']}) on {info['device']}: {info['machine']}.",
        f"{info['source']} at candidate buckets {info['candidates']}: {step} unbucketed, graph replay (median of "
        f"{info['iters']} back-to-back steps over prompts of {info['prompt_len']} tokens), capture seconds and graph "
        "memory (free device memory before/after, each bucket in a pool of its own).",
        f"Distribution of tokens per extend/mixed step: {info['distribution']}.",
        f"Budgets: {info['budget']}.",
        f"Expected extend step, tuned {list(tuned.sizes) or 'none'}: {describe(tuned, 'tokens', 'unbucketed')}.",
        f"Expected extend step, current {list(default.sizes) or 'none'}: {describe(default, 'tokens', 'unbucketed')}.",
        f"Tuned vs current: {gain:+.1f}% expected step time saved.",
        *info["extra"],
        f"Reproduce: {info['command']}",
    ]
    return lines


def tune_extend(args: argparse.Namespace, config: EngineConfig, platform: Any) -> int:
    """The --extend run: distribution, measurements (or --cost-table), selection, YAML + JSON + tables."""
    import json

    from engine.scheduler import max_step_tokens_for
    from engine.tuning.command import cost_model, run_summary

    started = time.perf_counter()

    max_tokens = max_step_tokens_for(config)
    current = parse_sizes(config.extend_capture_tokens) if config.extend_capture_tokens else []
    defaults = sorted({min(b, max_tokens) for b in current})
    distribution = load_distribution(args.distribution, args.metrics_url, max_tokens, args.api_key, TOKENS_HISTOGRAM)
    compiled = bool(config.compile_extend)
    logger.info(
        "extend buckets now %s (a step holds at most %d tokens); distribution %s",
        defaults or "none",
        max_tokens,
        distribution.summary("tokens"),
    )
    engine = step = None
    if args.cost_table:
        with open(args.cost_table, encoding="utf-8") as handle:
            saved = json.load(handle)
        report = MeasureReport.from_dict(saved["measurements"])
        compiled = bool(saved.get("compile_extend", compiled))
        candidates = sorted(m.size for m in report.sizes)
    else:
        candidates = (
            parse_sizes(args.candidates) if args.candidates else extend_candidates(defaults, distribution, max_tokens)
        )
        candidates = [c for c in candidates if 1 <= c <= max_tokens]
        if not candidates:
            raise ValueError(f"no candidate bucket <= {max_tokens} tokens (the largest step)")
        engine = _measurement_engine(args, max(max(candidates), distribution.max_size), args.prompt_len)
        logger.info(
            "measuring %d candidate token buckets %s over %s",
            len(candidates),
            candidates,
            "compiled extend steps" if compiled else "eager extend steps",
        )
        step = extend_step_fn(engine, compiled)
        report = measure_extend_buckets(engine, step, candidates, [distribution.max_size], args.prompt_len, args.iters)
        config.dtype = engine.config.dtype
    model = cost_model(report)
    default_eval = evaluate(defaults, distribution, model)
    budget = _budget(args, default_eval)
    tuned = select_sizes(distribution, model, budget)
    unbucketed = evaluate([], distribution, model)
    verified = (
        _verify(engine, step, {"tuned": list(tuned.sizes), "current": defaults})
        if engine is not None and step is not None and args.verify
        else {}
    )
    info = run_summary(
        args, config, platform.name, report, distribution, budget, tuned, default_eval, verified, [], candidates
    )
    info.update(
        compiled=compiled,
        prompt_len=report.context,
        distribution=distribution.summary("tokens"),
        source=f"Figures from the cost table {args.cost_table}, measured" if args.cost_table else "Measured",
    )
    output = args.output or os.path.join("configs", "tuned", f"{platform.name}-extend.yaml")
    tuned_for = {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "device": platform.name,
        "dtype": config.dtype,
        "page_size": int(config.page_size),
        "date": info["date"],
    }
    values = {"extend_capture_tokens": list(tuned.sizes), "compile_extend": compiled}
    write_tuned_yaml(output, values, _header(info, tuned, default_eval), tuned_for, kind="extend")
    json_path = args.json or os.path.splitext(output)[0] + ".json"
    write_json(
        json_path,
        {
            "date": info["date"],
            "command": info["command"],
            "machine": report.machine,
            "tuned_for": tuned_for,
            "kind": "extend",
            "compile_extend": compiled,
            "max_step_tokens": max_tokens,
            "distribution": {str(k): v for k, v in distribution.weights.items()},
            "distribution_source": distribution.source,
            "budget": asdict(budget),
            "current": default_eval.as_dict(),
            "tuned": tuned.as_dict(),
            "unbucketed": unbucketed.as_dict(),
            "verified": verified,
            "measurements": report.as_dict(),
            "seconds": time.perf_counter() - started,
        },
    )
    print()
    print_tables(
        [asdict(m) for m in report.sizes],
        distribution.weights,
        tuned,
        default_eval,
        [("unbucketed", unbucketed)],
        size_label="bucket",
        uncaptured="unbucketed",
        default_label="current",
        unit="tokens",
    )
    for name, figures in verified.items():
        print(f"{name} captured as the engine does: {figures['capture_s']:.2f} s, {figures['memory_mib']:.1f} MiB")
    print(f"\nwrote {output} and {json_path}; use it with: engine run|serve|bench --capture-config {output}")
    return 0
