"""`engine run`, `engine serve`, `engine bench` (and its subcommands) and `engine tune-capture` on the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from engine.cli_flags import add_setting_flags, values_from_args
from engine.errors import EngineError
from engine.platform import DeviceUnavailableError

if TYPE_CHECKING:
    from engine.config import EngineConfig

DEFAULT_PROMPT = "The capital of France is"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field's flag, and each device section's (--hpu-*), made from their definitions."""
    from backends import DEVICE_NAMES, device_sections
    from engine.config import EngineConfig

    group = parser.add_argument_group("engine")
    add_setting_flags(group, EngineConfig, placeholders={"devices": ", ".join(DEVICE_NAMES)})
    for section, settings in device_sections().items():
        add_setting_flags(
            parser.add_argument_group(f"{section} (the {section}: section of its device YAML)"), settings, section
        )


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The EngineConfig the flags describe; a device section's flags go over --device-options' section."""
    from backends import device_sections
    from engine.config import EngineConfig

    values = values_from_args(args, EngineConfig)
    options = {name: dict(section) for name, section in (values.get("device_options") or {}).items()}
    for section, settings in device_sections().items():
        if given := values_from_args(args, settings, section):
            options[section] = {**options.get(section, {}), **given}
    values["device_options"] = options
    values.update(overrides)
    return EngineConfig(**values)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def sampling_params_from_args(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.sampling_seed,
    )


def cmd_run(args: argparse.Namespace) -> int:
    from engine.engine import Engine

    params = sampling_params_from_args(args)  # validate before the slow model load
    prompts = args.prompt or [DEFAULT_PROMPT]
    config_overrides = {}
    if args.max_num_seqs is None:
        # One-shot run: never capture more sizes than there are prompts.
        config_overrides["max_num_seqs"] = len(prompts)
    start = time.perf_counter()
    engine = Engine(engine_config_from_args(args, **config_overrides))
    ready = time.perf_counter()
    logging.getLogger("engine").info("engine ready in %.1f s", ready - start)
    if len(prompts) == 1 and not args.no_stream:
        print(prompts[0], end="" if not args.chat else "\n", flush=True)
        for output in engine.stream(prompts, params, chat=args.chat):
            print(output.new_text, end="", flush=True)
        print()
    else:
        for prompt, output in zip(prompts, engine.generate(prompts, params, chat=args.chat)):
            print(f"--- {prompt!r}\n{output.text}  [{output.finish_reason}, {len(output.token_ids)} tokens]")
    logging.getLogger("engine").info("generation took %.2f s", time.perf_counter() - ready)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="graph-capture-centric LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate text for one or more prompts")
    add_engine_args(run)
    add_sampling_args(run)
    run.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    run.add_argument("--chat", action="store_true", help="apply the model's chat template")
    run.add_argument("--no-stream", action="store_true")
    run.set_defaults(func=cmd_run)
    bench = sub.add_parser("bench", help="decode throughput next to HF transformers")
    add_engine_args(bench)
    from engine.bench import add_bench_args, cmd_bench

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    # `engine bench serving ...`: an optional sub-command, so plain `engine bench` keeps working.
    bench_sub = bench.add_subparsers(dest="bench_command", required=False)
    serving = bench_sub.add_parser("serving", help="online benchmark of an OpenAI-compatible server")
    from engine.bench_serving import add_bench_serving_args, cmd_bench_serving

    add_bench_serving_args(serving)
    serving.set_defaults(func=cmd_bench_serving)
    latency = bench_sub.add_parser("latency", help="one static batch: prefill time and decode ms/step")
    add_engine_args(latency)
    from engine.bench_latency import add_bench_latency_args, cmd_bench_latency

    add_bench_latency_args(latency)
    latency.set_defaults(func=cmd_bench_latency)
    throughput = bench_sub.add_parser("throughput", help="offline requests of random lengths, HF generate_batch beside")
    add_engine_args(throughput)
    from engine.bench_throughput import add_bench_throughput_args, cmd_bench_throughput

    add_bench_throughput_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)
    tune = sub.add_parser(
        "tune-capture", help="measure capture sizes and write the best set for a batch-size distribution"
    )
    add_engine_args(tune)
    from engine.tuning.command import add_tune_args, cmd_tune_capture

    add_tune_args(tune)
    tune.set_defaults(func=cmd_tune_capture)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    from engine.server.launch import add_serve_args, cmd_serve

    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return int(args.func(args) or 0)
    except (EngineError, DeviceUnavailableError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
