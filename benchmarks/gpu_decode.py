"""Decode step time with graphs vs eager on one device, and graph-vs-eager token parity.

    PYTHONPATH=. python benchmarks/gpu_decode.py --device cuda --model llama-3-8b --load-format dummy \
        --batch-sizes 1,32 --context 512 --output bench_results/gpu_decode.json
    PYTHONPATH=. python benchmarks/gpu_decode.py --device cuda --parity-model path/to/SmolLM2.gguf

Prints a table and writes JSON. Graph replays and full engine steps are timed
back to back, as they run when serving (steady state: the host may prepare the
next step while the device runs this one, which is what overlap scheduling is
for): the median over 5 runs of --iters/5 consecutive calls, between two device
synchronizations. Eager forwards are timed one at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.tuning.measure import steady_ms  # the tuner times replays and steps the same way


def _device_ms(platform_sync, fn, iters: int) -> float:
    samples = []
    for _ in range(3):
        fn()
    for _ in range(iters):
        platform_sync()
        start = time.perf_counter()
        fn()
        platform_sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1)  # the sampling workload


def measure_decode(
    engine: Engine,
    batch_size: int,
    context: int,
    iters: int,
    sampled: bool = False,
    eager: bool = True,
    overlap_modes: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """Prefill batch_size random prompts of `context` tokens, then time decode steps (greedy, or SAMPLED),
    with overlap scheduling on and/or off (`overlap_modes`; the first is the headline figure)."""
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch_size)
    extra = SAMPLED if sampled else {"temperature": 0.0}
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, **extra)
    ids = []
    for _ in range(batch_size):
        prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
        ids.append(engine.add_request(prompt, params))
    while len(engine.scheduler.running) < batch_size:
        engine.step()  # prefill steps
    sync = engine.platform.synchronize
    engine.step()  # one decode so the static buffers hold this batch
    runner = engine.runner.graph_runner
    nan = float("nan")
    result: dict[str, Any] = {
        "batch_size": batch_size,
        "context": context,
        "sampling": extra,
        "graph_replay_ms": nan,
        "eager_forward_ms": nan,
        "engine_step_eager_ms": nan,
    }
    if runner is not None and not sampled:
        padded = runner.padded_size(batch_size)
        result["graph_replay_ms"] = steady_ms(sync, lambda: runner._replay(padded), iters)
        if eager:
            with torch.no_grad():
                result["eager_forward_ms"] = _device_ms(sync, lambda: runner.step_eager(padded), iters)
    configured = engine.overlap
    for overlap in overlap_modes:
        engine.overlap = overlap
        result[f"engine_step_graph_ms_overlap_{'on' if overlap else 'off'}"] = steady_ms(sync, engine.step, iters)
    engine.overlap = configured
    result["engine_step_graph_ms"] = result[f"engine_step_graph_ms_overlap_{'on' if overlap_modes[0] else 'off'}"]
    if eager and not sampled:
        engine.runner.graph_runner = None
        result["engine_step_eager_ms"] = steady_ms(sync, engine.step, iters)
        engine.runner.graph_runner = runner
    for request_id in ids:
        engine.abort(request_id)
    engine.check_kv_invariant()
    return result


def parity(model: str, device: str, dtype: str, steps: int) -> dict[str, Any]:
    """Greedy tokens with graphs vs eager for prompts of different lengths, batched (3 pads to 4)."""
    prompts = [
        "The capital of France is",
        "Write a short poem about the sea.",
        "List three prime numbers:",
    ]
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    results = {}
    for graphs in (True, False):
        engine = Engine(
            EngineConfig(
                model=model,
                device=device,
                dtype=dtype,
                capture_sizes="1,2,4",
                disable_graphs=not graphs,
                kv_cache_tokens=8192,
            )
        )
        outs = engine.generate(prompts, params)
        results[graphs] = [o.token_ids for o in outs]
        text = outs[0].text
        engine.check_kv_invariant()
        del engine
    same = results[True] == results[False]
    return {
        "model": model,
        "dtype": dtype,
        "graph_equals_eager": same,
        "steps": steps,
        "sample_text": text,
        "graph_tokens": results[True],
        "eager_tokens": results[False],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--capture-sizes", default=None)
    parser.add_argument(
        "--compile-decode", default="0,1", help="comma list of 0/1: graphs of the eager step, of the compiled step"
    )
    parser.add_argument(
        "--sampled-batch-sizes", default="", help="also time full steps with top-p/top-k/temperature/penalty"
    )
    parser.add_argument("--skip-eager", action="store_true", help="no eager-step timings (saves device time)")
    parser.add_argument(
        "--overlap-modes", default="1,0", help="comma list of 1/0: full steps with overlap scheduling on/off"
    )
    parser.add_argument("--parity-model", default=None, help="also check graph vs eager tokens on this model")
    parser.add_argument("--parity-dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--quantizations",
        default="auto",
        help="comma list of --quantization values to run in turn "
        "(e.g. auto,fp8: the bf16 weights, then the same weights quantized to FP8 at load)",
    )
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help="comma list of --kv-cache-dtype values (e.g. auto,fp8_e4m3)"
    )
    parser.add_argument("--output", default="bench_results/gpu_decode.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"torch": torch.__version__, "device": args.device}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    if args.parity_model:
        report["parity"] = [parity(args.parity_model, args.device, d, 48) for d in args.parity_dtypes.split(",")]
        for p in report["parity"]:
            print(f"parity {p['dtype']}: graph == eager: {p['graph_equals_eager']}; text: {p['sample_text']!r}")
    overlap_modes = tuple(flag == "1" for flag in args.overlap_modes.split(","))
    if args.model:
        report["runs"] = []
        variants = [
            (q, kv, flag == "1")
            for q in args.quantizations.split(",")
            for kv in args.kv_cache_dtypes.split(",")
            for flag in args.compile_decode.split(",")
        ]
        for quantization, kv_cache_dtype, compile_decode in variants:
            start = time.perf_counter()
            engine = Engine(
                EngineConfig(
                    model=args.model,
                    device=args.device,
                    dtype=args.dtype,
                    load_format=args.load_format,
                    capture_sizes=args.capture_sizes,
                    compile_decode=compile_decode,
                    quantization=quantization,
                    kv_cache_dtype=kv_cache_dtype,
                )
            )
            runner = engine.runner.graph_runner
            run = {
                "quantization": quantization,
                "kv_cache_dtype": kv_cache_dtype,
                "compile_decode": compile_decode,
                "startup_s": time.perf_counter() - start,
                "capture": {
                    "sizes": runner.capture_sizes,
                    "seconds": runner.capture_seconds,
                    "graph_memory_mib": runner.graph_memory_bytes / 2**20,
                },
                "decode": [
                    measure_decode(
                        engine, int(b), args.context, args.iters, eager=not args.skip_eager, overlap_modes=overlap_modes
                    )
                    for b in args.batch_sizes.split(",")
                ],
                "sampled": [
                    measure_decode(engine, int(b), args.context, args.iters, sampled=True, overlap_modes=overlap_modes)
                    for b in args.sampled_batch_sizes.split(",")
                    if b
                ],
            }
            report["runs"].append(run)
            print(
                f"model {args.model} ({args.dtype}, quantization {quantization}, KV {kv_cache_dtype}, "
                f"compile_decode={compile_decode}); start-up {run['startup_s']:.1f} s; "
                f"captured {len(runner.capture_sizes)} sizes in {runner.capture_seconds:.1f} s, "
                f"graph memory {runner.graph_memory_bytes / 2**20:.0f} MiB"
            )
            modes = [("on" if o else "off") for o in overlap_modes]
            print(
                f"{'bs':>4} {'replay ms':>10} {'eager fwd ms':>13}"
                + "".join(f" {'step ms (ovl ' + m + ')':>19} {'/replay':>8}" for m in modes)
                + f" {'step eager ms':>14}"
            )
            for row in run["decode"]:
                steps = "".join(
                    f" {row[f'engine_step_graph_ms_overlap_{m}']:>19.3f} "
                    f"{row[f'engine_step_graph_ms_overlap_{m}'] / row['graph_replay_ms']:>8.2f}"
                    for m in modes
                )
                print(
                    f"{row['batch_size']:>4} {row['graph_replay_ms']:>10.3f} {row['eager_forward_ms']:>13.3f}{steps} "
                    f"{row['engine_step_eager_ms']:>14.3f}"
                )
            greedy_by_bs = {row["batch_size"]: row["engine_step_graph_ms"] for row in run["decode"]}
            for row in run["sampled"]:
                base = greedy_by_bs.get(row["batch_size"])
                extra_ms = f", +{row['engine_step_graph_ms'] - base:.3f} ms over greedy" if base else ""
                print(
                    f"sampled bs {row['batch_size']} ({SAMPLED}): step {row['engine_step_graph_ms']:.3f} ms{extra_ms}"
                )
            del engine, runner
            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
