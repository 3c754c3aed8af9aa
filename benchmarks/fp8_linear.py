"""FP8 linear kernels against bf16 F.linear and the memory-bandwidth limit, under CUDA-graph replay.

    PYTHONPATH=. python benchmarks/fp8_linear.py --rows 1,16,32,64,128,256 --output bench_results/fp8_linear.json
    PYTHONPATH=. python benchmarks/fp8_linear.py --sweep --rows 1,16,32,64   # every Triton tile config too

Shapes are one Llama-3-8B layer's four matmuls (qkv, o, gate_up, down). Each variant is captured as
20 back-to-back calls in one CUDA graph (as decode replays them) and timed over replays; the table
gives microseconds per layer (the four matmuls), the weight bytes per microsecond they reached, and
the same for a device-to-device copy of the layer's bf16 weight bytes (the bandwidth limit measured
in the same run). Needs a GPU with FP8 (compute capability 8.9+).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from backends.cuda.fp8_linear import (
    WEIGHT_ONLY_MAX_ROWS,
    KernelConfig,
    choose_config,
    fp8_scaled_mm,
    fp8_weight_only_matmul,
)
from benchmarks.gpu_timing import graph_us as shared_graph_us
from engine.quantization.fp8 import fp8_reference_linear, quantize_per_channel

LLAMA3_8B_LAYER = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CALLS_PER_GRAPH = 20


def graph_us(fn: Callable[[], Any], replays: int = 10) -> float:
    """Microseconds per call of fn, captured CALLS_PER_GRAPH times in one CUDA graph."""
    return shared_graph_us([fn] * CALLS_PER_GRAPH, replays=1, groups=replays)


def sweep_configs(rows: int) -> list[KernelConfig]:
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return [
        KernelConfig(block_m, bn, bk, sk, nw, ns)
        for bn, bk, sk, nw, ns in itertools.product((16, 32, 64, 128), (128, 256, 512), (1, 2, 4), (4, 8), (3, 4))
        if not (bn >= 128 and bk >= 512)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,32,64,128,256")
    parser.add_argument("--sweep", action="store_true", help="time every Triton tile config, not only the chosen one")
    parser.add_argument("--output", default="bench_results/fp8_linear.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    weights = {}
    for name, (n, k) in LLAMA3_8B_LAYER.items():
        dense = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        weights[name] = (dense, *quantize_per_channel(dense))
    layer_bf16_bytes = sum(w[0].nbytes for w in weights.values())
    copy_src = torch.empty(layer_bf16_bytes, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_us = graph_us(lambda: copy_dst.copy_(copy_src))
    # A copy reads and writes every byte: its bandwidth is 2 x bytes / time.
    copy_bandwidth = 2 * layer_bf16_bytes / copy_us / 1e3
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_GBps": copy_bandwidth,
        "rows": {},
    }
    print(
        f"{torch.cuda.get_device_name()}; device copy {copy_bandwidth:.0f} GB/s; one Llama-3-8B layer: "
        f"{layer_bf16_bytes / 2**20:.0f} MiB bf16, {layer_bf16_bytes / 2 / 2**20:.0f} MiB FP8"
    )
    print(
        f"{'rows':>5} {'bf16 us':>9} {'GB/s':>6} {'fp8 chosen us':>14} {'GB/s':>6} {'scaled_mm us':>13} "
        f"{'triton us':>10} {'best sweep us':>14}  error vs reference"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        inputs = {
            name: (x if name != "down" else torch.randn(rows, 14336, device=device, dtype=torch.bfloat16))
            for name in LLAMA3_8B_LAYER
        }
        entry: dict[str, Any] = {}
        entry["bf16_us"] = sum(
            graph_us(lambda n=name, i=inputs: F.linear(i[n], weights[n][0])) for name in LLAMA3_8B_LAYER
        )
        entry["scaled_mm_us"] = sum(
            graph_us(lambda n=name, i=inputs: fp8_scaled_mm(i[n], weights[n][1], weights[n][2], None))
            for name in LLAMA3_8B_LAYER
        )
        entry["triton_us"] = sum(
            graph_us(lambda n=name, i=inputs: fp8_weight_only_matmul(i[n], weights[n][1], weights[n][2], None))
            for name in LLAMA3_8B_LAYER
        )
        entry["configs"] = {name: vars(choose_config(rows, *LLAMA3_8B_LAYER[name], device)) for name in LLAMA3_8B_LAYER}
        entry["chosen_us"] = entry["triton_us"] if rows <= WEIGHT_ONLY_MAX_ROWS else entry["scaled_mm_us"]
        errors = {}
        for name in LLAMA3_8B_LAYER:
            reference = fp8_reference_linear(inputs[name], weights[name][1], weights[name][2], None).float()
            got = torch.ops.engine.fp8_linear(inputs[name], weights[name][1], weights[name][2], None).float()
            errors[name] = ((got - reference).abs().max() / reference.abs().max()).item()
        entry["max_relative_error"] = errors
        if args.sweep:
            best: dict[str, Any] = {}
            for name in LLAMA3_8B_LAYER:
                timed = []
                for config in sweep_configs(rows):
                    try:
                        us = graph_us(
                            lambda n=name, c=config, i=inputs: fp8_weight_only_matmul(
                                i[n], weights[n][1], weights[n][2], None, c
                            ),
                            replays=5,
                        )
                    except Exception as exc:  # a config a shape cannot take (resources): skipped, named
                        timed.append((float("inf"), vars(config), type(exc).__name__))
                        continue
                    timed.append((us, vars(config), ""))
                timed.sort(key=lambda t: t[0])
                best[name] = {"us": timed[0][0], "config": timed[0][1], "top5": timed[:5]}
            entry["sweep_best"] = best
            entry["sweep_best_us"] = sum(b["us"] for b in best.values())
        report["rows"][rows] = entry
        fp8_bytes = layer_bf16_bytes / 2
        print(
            f"{rows:>5} {entry['bf16_us']:>9.1f} {layer_bf16_bytes / entry['bf16_us'] / 1e3:>6.0f} "
            f"{entry['chosen_us']:>14.1f} {fp8_bytes / entry['chosen_us'] / 1e3:>6.0f} {entry['scaled_mm_us']:>13.1f} "
            f"{entry['triton_us']:>10.1f} {entry.get('sweep_best_us', float('nan')):>14.1f}  "
            f"{max(errors.values()):.1e}"
        )
        if args.sweep:
            for name, b in entry["sweep_best"].items():
                print(f"      {name:>8}: best {b['us']:.1f} us with {b['config']}")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
