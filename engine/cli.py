"""`engine run`, `engine serve`, `engine bench` (and its subcommands) and `engine tune-capture` on the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.errors import EngineError
from engine.platform import DeviceUnavailableError

DEFAULT_PROMPT = "The capital of France is"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from backends import DEVICE_NAMES

    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="HF folder, .gguf file, or preset name (default: embedded SmolLM2-135M-Instruct)"
    )
    group.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICE_NAMES)}")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    group.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "fp8", "gguf", "none"],
        help="auto: the checkpoint's own (FP8 checkpoints in FP8; GGUF blocks kept on the CPU); fp8: also quantize a "
        "bf16/fp16 checkpoint's linears to FP8 at load (CUDA kernels); gguf: insist on the CPU's GGUF blocks; none: "
        "dequantize at load; docs/quantization.md",
    )
    group.add_argument(
        "--gguf-activations",
        default="auto",
        choices=["auto", "float32", "int8x2", "int8"],
        help="kept GGUF blocks, decode rows: auto (int8x2), float32 (exact), int8x2 (each block of 32 activations as "
        "two int8 levels, ~16 bits, integer dot products) or int8 (one level: llama.cpp's numerics, each activation "
        "rounded to 1/254 of its block's largest); docs/quantization.md",
    )
    group.add_argument("--page-size", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--kv-cache-tokens", type=int, default=None)
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"],
        help="the KV cache's dtype (auto: the model's; fp8 / fp8_e4m3: half the bytes of bf16, cuda's Triton "
        "attention only, scaled by the checkpoint's k/v scales where it has them; docs/quantization.md)",
    )
    group.add_argument(
        "--capture-sizes", default=None, help="comma-separated decode batch sizes to capture, e.g. 1,2,4,8"
    )
    group.add_argument(
        "--capture-config",
        default=None,
        help="YAML of tuned capture sizes (written by `engine tune-capture`); --capture-sizes wins over it",
    )
    group.add_argument("--max-capture-size", type=int, default=None)
    group.add_argument("--disable-graphs", action="store_true", help="run every step eagerly")
    group.add_argument("--strict-graphs", action="store_true", help="fail if anything compiles after warm-up")
    group.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cuda/rocm: torch.compile the decode step before capturing graphs (default from configs/<device>.yaml)",
    )
    group.add_argument(
        "--compile-extend",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile prefill, chunk and mixed steps, token count dynamic (default from configs/<device>.yaml: "
        "on for cuda)",
    )
    group.add_argument(
        "--extend-capture-tokens",
        default=None,
        help="cuda: token counts to capture extend/mixed-step CUDA graphs for, e.g. 16,64,256 ('' for none; default "
        "from configs/<device>.yaml)",
    )
    group.add_argument(
        "--disable-prefix-caching",
        "--disable-radix-cache",
        dest="disable_prefix_caching",
        action="store_true",
        help="do not reuse the KV of cached prompt prefixes",
    )
    group.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prefill at most this many prompt tokens per step (<= 0: off; default from configs/<device>.yaml)",
    )
    group.add_argument(
        "--max-extend-step-ms",
        type=float,
        default=None,
        help="cap the prompt tokens of an extend step so it takes at most this long, by its measured speed "
        "(<= 0: off; default from configs/<device>.yaml)",
    )
    group.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and prepare the next step while the device runs this one (default from "
        "configs/<device>.yaml: on for cuda/rocm); --no-overlap-schedule to debug",
    )
    group.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run decodes and prefill chunks in one ragged step (default from configs/<device>.yaml: on for "
        "cuda/rocm); --no-mixed-steps keeps separate prefill and decode steps",
    )
    group.add_argument("--debug-kv-invariant", action="store_true", help="check the KV pool invariant after every step")
    group.add_argument(
        "--freeze-gc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after start-up, move its Python objects out of the cyclic garbage collector's scans until shutdown, "
        "as vLLM does (default: on for serve and bench throughput, which hold one engine for the process's life)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks, one process each (NCCL on CUDA, gloo on CPU); docs/tensor_parallel.md",
    )
    group.add_argument(
        "--dist-timeout",
        dest="dist_timeout_s",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="tensor parallelism: how long a collective waits for the other ranks before the engine fails naming "
        "the rank that did not respond",
    )
    group.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace, **overrides: object):
    from engine.config import EngineConfig

    values = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        gguf_activations=args.gguf_activations,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        capture_sizes=args.capture_sizes,
        capture_config=args.capture_config,
        max_capture_size=args.max_capture_size,
        disable_graphs=args.disable_graphs,
        strict_graphs=args.strict_graphs,
        compile_decode=args.compile_decode,
        compile_extend=args.compile_extend,
        extend_capture_tokens=args.extend_capture_tokens,
        enable_prefix_caching=not args.disable_prefix_caching,
        chunked_prefill_size=args.chunked_prefill_size,
        max_extend_step_ms=args.max_extend_step_ms,
        overlap_schedule=args.overlap_schedule,
        mixed_steps=args.mixed_steps,
        debug_kv_invariant=args.debug_kv_invariant,
        freeze_gc=args.freeze_gc,
        tensor_parallel_size=args.tensor_parallel_size,
        dist_timeout_s=args.dist_timeout_s,
        seed=args.seed,
    )
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
    from graphs.tune import add_tune_args, cmd_tune_capture

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
