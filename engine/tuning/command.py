"""`engine tune-capture`: measure candidate decode capture sizes on this device, choose the set that minimises
the expected decode step for a batch-size distribution within memory / capture-time / graph budgets, and
write it where the engine loads it (docs/tuning.md).

    engine tune-capture --device cpu --candidates 1,2,3,4,6,8,12,16 --output configs/tuned/cpu-smollm2.yaml
    engine run --capture-config configs/tuned/cpu-smollm2.yaml ...

Steps: the baseline (the sizes the engine would capture today: configs/<device>.yaml or --capture-sizes),
the distribution (engine/tuning/distribution.py), the measurements (engine/tuning/measure.py, or a previous
run's JSON through --cost-table), the selection (engine/tuning/select.py; HPU and NPU:
engine/tuning/buckets.py), optionally the chosen and default sets captured as the engine captures them
(--verify) and a drawn workload replayed through Engine.step with each (--workload-steps), then the
YAML, the JSON and the tables (engine/tuning/output.py).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from engine.capture_sizes import cap_sizes, parse_sizes
from engine.platform import CaptureKind, Platform
from engine.tuning.distribution import SizeDistribution, load_distribution
from engine.tuning.measure import MEASURABLE_KINDS, MeasureReport, describe_machine
from engine.tuning.output import decode_values, header_lines, print_tables, write_json, write_tuned_yaml
from engine.tuning.select import Budget, CostModel, Evaluation, SizeCost, candidate_sizes, evaluate, select_sizes

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine

logger = logging.getLogger("engine.tune")


def _budget_value(text: str) -> float:
    value = float(text)
    if value <= 0 and not math.isinf(value):
        raise argparse.ArgumentTypeError("a budget must be positive (or inf for none)")
    return value


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tune-capture")
    group.add_argument(
        "--distribution",
        default=None,
        help="decode batch-size distribution: a JSON/CSV file of size -> count (or observed sizes), a "
        "saved /metrics text, or a spec like '1-8:0.1,33-40:0.6,65-72:0.3' (default: log-uniform, p(b) ~ 1/b)",
    )
    group.add_argument(
        "--metrics-url",
        default=None,
        help="read the distribution from a running server's /metrics (engine:decode_batch_size)",
    )
    group.add_argument("--api-key", default=None, help="the server's API key for --metrics-url (or ENGINE_API_KEY)")
    group.add_argument(
        "--candidates",
        default=None,
        help="candidate sizes to measure, e.g. 1,2,4,8,16 (default: the default sizes, the default "
        "grid and the distribution's quantiles)",
    )
    group.add_argument(
        "--memory-budget-mib",
        type=_budget_value,
        default=None,
        help="graph memory the tuned set may use (default: what the default sizes use; inf: none)",
    )
    group.add_argument(
        "--capture-time-budget-s",
        type=_budget_value,
        default=None,
        help="capture seconds at start-up the tuned set may use (default: the default sizes'; inf: none)",
    )
    group.add_argument(
        "--max-graphs",
        type=int,
        default=None,
        help="at most this many graphs (npu: the aclgraph budget of the model's layer count)",
    )
    group.add_argument("--cover", type=int, default=None, help="the largest tuned size must be at least this")
    group.add_argument("--context", type=int, default=512, help="tokens per row while timing (KV read per step)")
    group.add_argument("--iters", type=int, default=20, help="timed steps per measurement (median of 5 groups)")
    group.add_argument(
        "--cost-table",
        default=None,
        help="skip measuring: reuse the measurements of a previous run's JSON (or figures measured "
        "on hpu/npu in the same form)",
    )
    group.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture the tuned and the default sets as the engine does and report their real capture time and memory",
    )
    group.add_argument(
        "--workload-steps",
        type=int,
        default=0,
        help="replay this many decode steps drawn from the distribution through Engine.step, tuned vs "
        "default sizes (padding waste and step time)",
    )
    group.add_argument(
        "--workload-max-sizes", type=int, default=48, help="distinct batch sizes the replay times at most"
    )
    group.add_argument(
        "--hpu-block-steps",
        default="32,64,128,256",
        help="hpu: block-bucket steps to search (with --device hpu and --cost-table)",
    )
    group.add_argument(
        "--prompt-lengths",
        default=None,
        help="hpu: prompt-length distribution for the prompt buckets: a JSON/CSV file (observed lengths, "
        "or length -> weight) or a spec like '100-200:0.8,2000:0.2' (default: --metrics-url's "
        "engine:request_prompt_tokens histogram, else uniform 256-768, the throughput benchmark's prompts); "
        "needs prompt_points in --cost-table",
    )
    group.add_argument(
        "--prompts-per-step",
        type=int,
        default=1,
        help="hpu: prompts per prefill step to price (above 1, a seeded draw of steps, grouped as the "
        "prefill runner groups them)",
    )
    group.add_argument(
        "--max-prompt-buckets",
        type=int,
        default=None,
        help="hpu: at most this many prompt buckets (default: as many as configs/hpu.yaml warms now)",
    )
    group.add_argument(
        "--prompt-warmup-budget-s",
        type=_budget_value,
        default=None,
        help="hpu: prompt-bucket warm-up seconds (warmup_s_per_prompt_bucket each; default: none)",
    )
    group.add_argument("--hpu-prompt-seq-steps", default="32,64,128,256", help="hpu: prompt_seq_bucket steps to search")
    group.add_argument(
        "--extend",
        action="store_true",
        help="tune the token-count buckets of extend/mixed-step CUDA graphs (extend_capture_tokens) "
        "instead of decode sizes: --distribution and --metrics-url then give tokens per step "
        "(engine:extend_step_tokens), --candidates token buckets (engine/tuning/extend.py)",
    )
    group.add_argument(
        "--prompt-len",
        type=int,
        default=512,
        help="--extend: a measured step of t tokens is prompts of this many tokens (the last shorter)",
    )
    group.add_argument(
        "--prefix-lengths",
        default=None,
        help="hpu: cached prefix tokens of the prefill steps that have one (a JSON/CSV file or a spec "
        "like '512-2048:0.7,4096:0.3'), to tune hpu.prompt_ctx_bucket; needs ctx_points in --cost-table",
    )
    group.add_argument(
        "--max-prompt-ctx-buckets",
        type=int,
        default=None,
        help="hpu: at most this many prefix buckets (default: hpu.max_prompt_ctx_buckets)",
    )
    group.add_argument("--hpu-ctx-steps", default="1,2,4,8", help="hpu: prompt_ctx_bucket steps (pages) to search")
    group.add_argument(
        "--output",
        default=None,
        help="YAML to write (default configs/tuned/<device>-<model>.yaml; an existing device file such "
        "as configs/cpu.yaml is updated in place)",
    )
    group.add_argument("--json", default=None, help="JSON of everything measured (default: the YAML's path, .json)")


# ---- the baseline and the candidates -------------------------------------------------------------


def _slug(model: str | None, load_format: str) -> str:
    name = "smollm2" if model is None else os.path.basename(os.path.normpath(model))
    name = re.sub(r"\.(gguf|json)$", "", name.lower())
    return re.sub(r"[^a-z0-9.]+", "-", name).strip("-") + ("-dummy" if load_format == "dummy" else "")


def _platform_for(device: str, cost_table: bool) -> Platform:
    """The platform; with a cost table the class alone will do (selection reads only the device's YAML, so
    figures measured on a GPU or a Gaudi can be re-selected on any machine)."""
    from backends import get_platform, platform_class

    if cost_table and device != "auto":
        return platform_class(device)()
    return get_platform(device)


def cost_model(report: MeasureReport) -> CostModel:
    costs = [SizeCost(m.size, m.replay_ms, m.memory_mib, m.capture_s) for m in report.sizes]
    return CostModel(
        costs,
        report.eager_points,
        report.fixed_capture_s,
        report.fixed_memory_mib,
        report.logits_mib_per_row,
        shared_pool=report.capture_kind == CaptureKind.CUDA_GRAPH,
    )


# ---- measuring -----------------------------------------------------------------------------------


def _measurement_engine(args: argparse.Namespace, rows: int, context: int, workload_rows: int, growth: int) -> Engine:
    """A real engine with graphs off (it captures nothing of its own), rows enough for every measurement,
    and a KV pool for `rows` rows of `context` tokens and for the workload's requests, which grow by
    `growth` tokens over the replay."""
    from backends import get_platform
    from engine.cli import engine_config_from_args
    from engine.engine import Engine

    config = engine_config_from_args(args, disable_graphs=True, warmup=False, max_num_seqs=rows)
    # At least one full context too: the engine would otherwise lower max_model_len to the pool, and the page
    # tables (graphs/static_buffers.py) would be narrower than the served engine's.
    resolved = config.resolve(get_platform(args.device))
    max_len, page = int(resolved.max_model_len), int(resolved.page_size)
    # Each workload request holds its prompt and every token it generates, in whole pages, with 25% to spare
    # for the scheduler's reserve.
    workload = int(1.25 * workload_rows * (context + growth + 2 * page))
    config.kv_cache_tokens = max(rows * (context + 2 * page), workload, max_len)
    return Engine(config)


def _verify(engine: Engine, sets: dict[str, list[int]]) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Capture each set as Engine._graph_runner does (one runner, one shared pool); real seconds and memory."""
    from engine.tuning.measure import make_runner, rss_bytes

    figures, runners = {}, {}
    for name, sizes in sets.items():
        runner = make_runner(engine, sizes)
        rss = rss_bytes()
        runner.capture()
        memory = runner.graph_memory_bytes or max(0, rss_bytes() - rss)
        figures[name] = {
            "capture_s": runner.capture_seconds,
            "memory_mib": memory / 2**20,
            "memory_source": "device" if runner.graph_memory_bytes else "rss",
        }
        runners[name] = runner
    return figures, runners


# ---- the command ---------------------------------------------------------------------------------


def _resolved_baseline(args: argparse.Namespace) -> tuple[EngineConfig, Platform]:
    from engine.cli import engine_config_from_args

    platform = _platform_for(args.device, bool(args.cost_table))
    return engine_config_from_args(args).resolve(platform), platform


def _budget(
    args: argparse.Namespace, default: Evaluation, platform: Platform, config: EngineConfig, num_layers: int | None
) -> Budget:
    max_graphs = args.max_graphs
    limit = platform.max_captured_graphs(num_layers, config.device_config) if num_layers else None
    if limit is not None:
        max_graphs = limit if max_graphs is None else min(max_graphs, limit)
    memory = default.memory_mib if args.memory_budget_mib is None else args.memory_budget_mib
    capture = default.capture_s if args.capture_time_budget_s is None else args.capture_time_budget_s
    return Budget(
        memory_mib=None if math.isinf(memory) else max(memory, 1e-6),
        capture_s=None if math.isinf(capture) else max(capture, 1e-6),
        max_graphs=max_graphs,
        cover=args.cover,
        allow_empty=False,
    )


def cmd_tune_capture(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    config, platform = _resolved_baseline(args)
    if int(config.tensor_parallel_size) > 1:
        # The tuner replays the engine's runners directly; the other ranks would never see those steps.
        raise ValueError("tune-capture measures one rank; run it with --tensor-parallel-size 1")
    if args.extend:
        from engine.tuning.extend import tune_extend

        return tune_extend(args, config, platform)
    max_size = int(config.max_num_seqs)
    defaults = cap_sizes(
        parse_sizes(config.capture_sizes) or [1], min(int(config.max_capture_size or max_size), max_size)
    )
    distribution = load_distribution(args.distribution, args.metrics_url, max_size, args.api_key)
    logger.info("baseline sizes %s (max_num_seqs %d); distribution %s", defaults, max_size, distribution.summary())
    if platform.bucketed_steps:
        from engine.tuning.hpu import tune_hpu

        return tune_hpu(args, config, distribution)
    if not args.cost_table and platform.capture_settings().kind not in MEASURABLE_KINDS:
        raise ValueError(
            f"tune-capture measures on cpu, cuda and rocm; on {platform.name} pass --cost-table with figures "
            "measured there (docs/tuning.md)"
        )
    engine = None
    num_layers = None
    if args.cost_table:
        import json

        with open(args.cost_table, encoding="utf-8") as handle:
            saved = json.load(handle)
        report = MeasureReport.from_dict(saved["measurements"])
        num_layers = saved.get("model", {}).get("num_layers")
        candidates = sorted(m.size for m in report.sizes)
    else:
        candidates = (
            parse_sizes(args.candidates) if args.candidates else candidate_sizes(defaults, distribution, max_size)
        )
        candidates = [c for c in candidates if c <= max_size]
        if not candidates:
            raise ValueError(f"no candidate size <= max_num_seqs {max_size}")
        from engine.tuning.measure import measure_candidates
        from engine.tuning.workload import workload_growth

        eager_sizes = set(candidates) | {distribution.max_size}
        levels = min(len(distribution.weights), args.workload_max_sizes) if args.workload_steps else 0
        growth = workload_growth(levels, args.iters, 2) if levels else 0
        rows = max(max(candidates), max(defaults), distribution.max_size)
        engine = _measurement_engine(args, rows, args.context, distribution.max_size if levels else 0, growth)
        num_layers = engine.model_config.num_hidden_layers
        logger.info(
            "measuring %d candidate sizes %s (eager also at %s)",
            len(candidates),
            candidates,
            sorted(eager_sizes - set(candidates)) or "the candidates",
        )
        report = measure_candidates(engine, candidates, sorted(eager_sizes), args.context, args.iters)
        config.dtype = engine.config.dtype  # what the engine ran in (a GGUF on the CPU: float32 blocks)
    model = cost_model(report)
    default_eval = evaluate(defaults, distribution, model)
    budget = _budget(args, default_eval, platform, config, num_layers)
    tuned = select_sizes(distribution, model, budget)
    unlimited = select_sizes(
        distribution, model, Budget(max_graphs=budget.max_graphs, cover=budget.cover, allow_empty=False)
    )
    eager_only = evaluate([], distribution, model)
    if eager_only.expected_ms < tuned.expected_ms:
        logger.warning(
            "every batch eager (%.3f ms/step) beats the best captured set (%.3f ms/step) on this "
            "device: --disable-graphs is faster here",
            eager_only.expected_ms,
            tuned.expected_ms,
        )
    verified: dict[str, Any] = {}
    workload: list[dict[str, Any]] = []
    if engine is not None and (args.verify or args.workload_steps):
        verified, runners = _verify(engine, {"tuned": list(tuned.sizes), "default": defaults})
        if args.workload_steps:
            from engine.tuning.workload import replay_workload

            results = replay_workload(
                engine,
                runners,
                distribution,
                args.workload_steps,
                args.iters,
                args.context,
                seed=args.seed,
                max_sizes=args.workload_max_sizes,
            )
            workload = [asdict(r) for r in results]
        del runners
    info = run_summary(
        args, config, platform.name, report, distribution, budget, tuned, default_eval, verified, workload, candidates
    )
    output = args.output or os.path.join(
        "configs", "tuned", f"{platform.name}-{_slug(args.model, args.load_format)}.yaml"
    )
    tuned_for = {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "device": platform.name,
        "dtype": config.dtype,
        "page_size": int(config.page_size),
        "date": info["date"],
    }
    write_tuned_yaml(output, decode_values(tuned.sizes), header_lines(info), tuned_for)
    json_path = args.json or os.path.splitext(output)[0] + ".json"
    write_json(
        json_path,
        {
            "date": info["date"],
            "command": info["command"],
            "machine": report.machine,
            "tuned_for": tuned_for,
            "model": {"num_layers": num_layers},
            "distribution": {str(k): v for k, v in distribution.weights.items()},
            "distribution_source": distribution.source,
            "budget": asdict(budget),
            "default": default_eval.as_dict(),
            "tuned": tuned.as_dict(),
            "unlimited_budget": unlimited.as_dict(),
            "eager_only": eager_only.as_dict(),
            "verified": verified,
            "workload": workload,
            "measurements": report.as_dict(),
            "seconds": time.perf_counter() - started,
        },
    )
    print()
    others = [("no budget", unlimited)] if unlimited.sizes != tuned.sizes else []
    print_tables(
        [asdict(m) for m in report.sizes],
        distribution.weights,
        tuned,
        default_eval,
        [*others, ("eager only", eager_only)],
    )
    for name, figures in verified.items():
        print(
            f"{name} captured as the engine does: {figures['capture_s']:.2f} s, {figures['memory_mib']:.1f} MiB "
            f"({figures['memory_source']})"
        )
    for row in workload:
        print(
            f"workload {row['name']:<8} {row['sizes']}: {row['mean_step_ms']:.3f} ms/step over {row['steps']} steps, "
            f"padding {row['padding_rows']:.2f} rows/step ({100 * row['padded_fraction']:.1f}%), "
            f"{row['eager_steps']} eager steps"
        )
    print(f"\nwrote {output} and {json_path}; use it with: engine run|serve --capture-config {output}")
    return 0


def run_summary(
    args: argparse.Namespace,
    config: EngineConfig,
    device: str,
    report: MeasureReport,
    distribution: SizeDistribution,
    budget: Budget,
    tuned: Evaluation,
    default: Evaluation,
    verified: dict[str, Any],
    workload: list[dict[str, Any]],
    candidates: list[int],
) -> dict[str, Any]:
    """What the tuned file's header and the JSON say about a run (shared by the decode and extend tunings)."""
    parts = []
    if budget.memory_mib is not None:
        parts.append(f"graph memory <= {budget.memory_mib:.1f} MiB")
    if budget.capture_s is not None:
        parts.append(f"capture <= {budget.capture_s:.1f} s")
    if budget.max_graphs is not None:
        parts.append(f"<= {budget.max_graphs} graphs")
    if budget.cover is not None:
        parts.append(f"largest size >= {budget.cover}")
    source = {"rss": "process RSS growth", "device": "free device memory before/after"}
    extra = [
        f"Captured as the engine does: {name} {f['capture_s']:.1f} s, {f['memory_mib']:.0f} MiB ({f['memory_source']})."
        for name, f in verified.items()
    ]
    extra += [
        f"Replayed workload ({w['steps']} drawn steps through Engine.step): {w['name']} {w['mean_step_ms']:.3f} "
        f"ms/step, padding {w['padding_rows']:.2f} rows/step, {w['eager_steps']} eager steps."
        for w in workload
    ]
    argv = sys.argv[1:] if sys.argv and os.path.basename(sys.argv[0]) in ("engine", "cli.py", "__main__.py") else []
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": args.model or "the embedded SmolLM2-135M-Instruct",
        "dtype": config.dtype,
        "page_size": config.page_size,
        "device": device,
        "machine": describe_machine(report.machine),
        "candidates": candidates,
        "iters": report.iters,
        "context": report.context,
        "memory_source": ", ".join(sorted({source.get(m.memory_source, m.memory_source) for m in report.sizes})),
        "distribution": distribution.summary(),
        "budget": "; ".join(parts) or "none",
        "cache": "inductor FX graph cache during the first captures: "
        f"{sum(m.fx_cache_hits for m in report.sizes)} hits, {sum(m.fx_cache_misses for m in report.sizes)} misses",
        "tuned": tuned,
        "default": default,
        "extra": extra,
        "command": "engine " + " ".join(shlex.quote(a) for a in argv) if argv else "engine tune-capture ...",
    }
