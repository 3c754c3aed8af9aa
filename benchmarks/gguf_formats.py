"""The CPU's GGUF kernels per format: one matmul of a decode step, next to torch's float matmul of the same matrix.

    PYTHONPATH=. python benchmarks/gguf_formats.py --rows 1,16 --output bench_results/gguf_formats.json

For every format with a native kernel (backends/cpu/gguf_linear.py FORMATS), a [out, in] weight of random
blocks (scales set to sane fp16 values), cycled over --matrices distinct copies (raise it until their bytes
outgrow the last-level cache when DRAM's rate is the question), multiplied by 1 and 16 activation rows
(batch-1 and batch-16 decode) in the default activation mode (int8x2) and in float32. Beside each: torch's
F.linear on the same matrices dequantized to float32 and to bfloat16 (what the engine did before, and HF's
faster dtype). Prints ms per matmul, the weight bytes streamed per second, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from backends.cpu import gguf_linear as gl
from engine.tuning.measure import steady_ms

# Byte offsets of each block's fp16 scales (d, and the minimum where there is one): ggml's block layouts.
SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q8_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q3_K": (108,),
    "Q2_K": (80, 82),
}


def random_tiles(fmt: gl.BlockFormat, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // fmt.block_columns, fmt.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[fmt.name]:
        blocks[..., offset : offset + 2] = (
            rng.uniform(1e-4, 2e-3, (*blocks.shape[:2], 1)).astype(np.float16).view(np.uint8)
        )
    return gl.tile_blocks(fmt, blocks.reshape(rows, -1))


def _no_sync() -> None:
    """The CPU runs each call to completion: nothing to wait for."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--matrices", type=int, default=8, help="distinct matrices cycled through (outgrow the caches)")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", default="bench_results/gguf_formats.json")
    args = parser.parse_args()
    out_f, in_f, count = args.out_features, args.in_features, args.matrices
    print(
        f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
        f"kernels: {gl.describe_paths()}"
    )
    results: list[dict[str, Any]] = []
    dense_ms: dict[tuple[str, int], float] = {}
    for name, fmt in gl.FORMATS.items():
        tiles = [random_tiles(fmt, out_f, in_f, seed) for seed in range(count)]
        weights = [gl.dequantize_tiles(t, fmt.code, out_f, in_f) for t in tiles]
        nbytes = sum(t.numel() for t in tiles) / count
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f)
            for mode in ("int8x2", "float32"):
                level = gl.ACTIVATIONS[mode]
                ms = (
                    steady_ms(
                        _no_sync,
                        lambda x=x, fmt=fmt, level=level, tiles=tiles: [
                            gl.gguf_linear(x, [t], [fmt.code], [out_f], level) for t in tiles
                        ],
                        args.repeats,
                    )
                    / count
                )
                results.append(
                    {
                        "format": name,
                        "rows": rows,
                        "activations": mode,
                        "ms": ms,
                        "bits_per_weight": 8 * fmt.block_bytes / fmt.block_columns,
                        "weight_gb_s": nbytes / ms / 1e6,
                    }
                )
            for dtype in (torch.float32, torch.bfloat16):  # the same matrices dense: what the float path streams
                key = (str(dtype).split(".")[-1], rows)
                if key not in dense_ms:
                    dense = [w.to(dtype) for w in weights]
                    xd = x.to(dtype)
                    dense_ms[key] = (
                        steady_ms(_no_sync, lambda xd=xd, dense=dense: [F.linear(xd, w) for w in dense], args.repeats)
                        / count
                    )
        del weights
    print(f"\n[{out_f} x {in_f}] weight, ms per matmul (median of 5 timed groups, {count} matrices cycled)")
    print(
        f"{'format':<7}{'bits/w':>7}{'rows':>6}{'int8x2 ms':>11}{'GB/s':>7}{'fp32-act ms':>13}{'GB/s':>7}"
        f"{'torch f32':>11}{'torch bf16':>12}"
    )
    for name in gl.FORMATS:
        for rows in (int(r) for r in args.rows.split(",")):
            q8, f32 = (
                next(r for r in results if r["format"] == name and r["rows"] == rows and r["activations"] == mode)
                for mode in ("int8x2", "float32")
            )
            print(
                f"{name:<7}{q8['bits_per_weight']:>7.2f}{rows:>6}{q8['ms']:>11.3f}{q8['weight_gb_s']:>7.1f}{f32['ms']:>13.3f}"
                f"{f32['weight_gb_s']:>7.1f}{dense_ms[('float32', rows)]:>11.3f}{dense_ms[('bfloat16', rows)]:>12.3f}"
            )
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "shape": [out_f, in_f],
                "threads": torch.get_num_threads(),
                "kernels": gl.describe_paths(),
                "results": results,
                "torch_dense_ms": {f"{d}_rows{r}": ms for (d, r), ms in dense_ms.items()},
            },
            handle,
            indent=1,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
