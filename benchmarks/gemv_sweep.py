"""One- or two-row matmuls on the GPU: cuBLAS (F.linear) against the Triton GEMV's tiles, bf16 and FP8 weights.

    PYTHONPATH=. python benchmarks/gemv_sweep.py --output bench_results/gemv_sweep.json

Llama-3-8B's shapes at batch 1 (`--model NAME`: a preset's under configs/models/, e.g. gemma-2-9b). Each
candidate is timed under CUDA-graph replay over 8 distinct copies of the weight (more bytes than the L2
holds, as a model's layers are), so each call streams its weight from HBM as in a decode step; a
device-to-device copy in the same run gives the bandwidth ceiling.
Prints a table per shape (best GEMV tile, its time and TB/s against cuBLAS's) and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import Any

import torch

from backends.cuda.gemv import GemvConfig, choose_config, gemv
from benchmarks.gpu_timing import copy_rate_bytes_per_s, graph_us, preset_config

SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}
COPIES = 8


def preset_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(out, in) of a preset's decode matrices: fused q/k/v, o, fused gate/up, down, LM head."""
    config = preset_config(name)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-n", default="4,8,16")
    parser.add_argument("--block-k", default="512,1024")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument(
        "--rows",
        type=int,
        default=1,
        help="activation rows: 1, or 2 (the two-row GEMV measured in docs/cuda.md, session (e))",
    )
    parser.add_argument("--model", default=None, help="a preset under configs/models/ (default: Llama-3-8B's shapes)")
    parser.add_argument("--output", default="bench_results/gemv_sweep.json")
    args = parser.parse_args()
    shapes = preset_shapes(args.model) if args.model else SHAPES
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    configs = [
        GemvConfig(*c)
        for c in itertools.product(ints(args.block_n), ints(args.block_k), ints(args.warps), ints(args.stages))
    ]
    ceiling = copy_rate_bytes_per_s() / 1e12
    print(f"device copy: {ceiling:.2f} TB/s")
    results: list[dict[str, Any]] = []
    torch.manual_seed(0)
    x = torch.randn(args.rows, max(k for _, k in shapes.values()), dtype=torch.bfloat16, device="cuda")
    for dtype_name in args.dtypes.split(","):
        for name, (n, k) in shapes.items():
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(COPIES)]
            xk = x[:, :k]
            row: dict[str, Any] = {"dtype": dtype_name, "layer": name, "n": n, "k": k, "rows": args.rows}
            if dtype_name == "fp8":
                from backends.cuda.fp8_linear import fp8_weight_only_matmul
                from engine.quantization.fp8 import quantize_per_channel

                quantized = [quantize_per_channel(w) for w in weights]
                del weights
                bytes_per_call = n * k
                row["baseline"] = "triton fp8_weight_only_matmul"
                row["baseline_us"] = graph_us(
                    [lambda q=q, xk=xk: fp8_weight_only_matmul(xk, q[0], q[1], None) for q in quantized]
                )
                chosen = choose_config(n, k, 1)
                candidates = {
                    c: [lambda q=q, c=c, xk=xk: gemv(xk, q[0], None, q[1], c) for q in quantized]
                    for c in dict.fromkeys([*configs, chosen])
                }
            else:
                bytes_per_call = 2 * n * k
                row["baseline"] = "cublas F.linear"
                row["baseline_us"] = graph_us([lambda w=w, xk=xk: torch.nn.functional.linear(xk, w) for w in weights])
                chosen = choose_config(n, k, 2)
                candidates = {
                    c: [lambda w=w, c=c, xk=xk: gemv(xk, w, None, None, c) for w in weights]
                    for c in dict.fromkeys([*configs, chosen])
                }
            timings = []
            for config, calls in candidates.items():
                try:
                    timings.append((graph_us(calls), config))
                except Exception as exc:  # a tile Triton cannot build (registers, shared memory): skip it
                    print(f"  {config}: {type(exc).__name__}")
            best_us, best = min(timings, key=lambda t: t[0])
            chosen_us = next((us for us, c in timings if c == chosen), float("nan"))
            row.update(
                best_us=best_us,
                best=best.__dict__,
                chosen=chosen.__dict__,
                chosen_us=chosen_us,
                baseline_tbs=bytes_per_call / row["baseline_us"] / 1e6,
                best_tbs=bytes_per_call / best_us / 1e6,
                all=[{"us": us, **c.__dict__} for us, c in sorted(timings, key=lambda t: t[0])],
            )
            results.append(row)
            print(
                f"{dtype_name:5} {name:13} {row['baseline']:32} {row['baseline_us']:8.1f} us "
                f"({row['baseline_tbs']:.2f} TB/s) | GEMV best {best_us:8.1f} us ({row['best_tbs']:.2f} TB/s) {best} "
                f"| engine's tile {chosen_us:8.1f} us"
            )
            del candidates
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_tbs": ceiling,
                "results": results,
            },
            handle,
            indent=1,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
