"""Paged decode attention on the GPU: the Triton kernel's launch tiles against the KV bytes it must read.

    PYTHONPATH=. python benchmarks/attention_sweep.py --batch-sizes 1,32,128,256,512 --contexts 512,1024,7000 \
        --output bench_results/attention_sweep.json

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16) over one layer's paged
cache, each request's pages scattered over the pool as a long-running server leaves them. Each launch
stores the step's new k/v as the engine's decode graphs do. Timed under CUDA-graph replay; the KV bytes a
launch reads (every request's context, k and v) over its time give GB/s, next to a device-to-device copy in
the same run (the bandwidth ceiling). Prints, per (batch, context), the default tile's time and the best
tile's, and writes JSON with every candidate.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from backends.cuda.triton_decode import DecodeTile, decode_splits, decode_tile, paged_decode_attention_triton
from benchmarks.gpu_timing import copy_rate_bytes_per_s, graph_us

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def parse_tiles(text: str) -> list[DecodeTile]:
    """ "64x4x3,128x8x2": block_n x num_warps x num_stages (0 stages: Triton's default)."""
    tiles = []
    for item in text.split(","):
        block_n, warps, stages = (int(x) for x in item.split("x"))
        tiles.append(DecodeTile(block_n, warps, stages or None))
    return tiles


def decode_case(
    batch: int, context: int, page_size: int, tiles: list[DecodeTile], splits: int | None, verbose: bool = False
) -> dict[str, Any]:
    rows, chosen_splits, kv_bytes = _time_tiles(batch, context, page_size, tiles, splits, verbose)
    torch.cuda.empty_cache()  # the case's cache went with _time_tiles's frame
    return {
        "batch": batch,
        "context": context,
        "page_size": page_size,
        "splits": chosen_splits,
        "kv_bytes": kv_bytes,
        "tiles": rows,
    }


def _time_tiles(
    batch: int, context: int, page_size: int, tiles: list[DecodeTile], splits: int | None, verbose: bool
) -> tuple[list[dict[str, Any]], int, int]:
    """One layer's paged cache for (batch, context), each tile's launch timed over it: (rows, splits, KV bytes)."""
    from triton.runtime.errors import OutOfResources

    device = torch.device("cuda")
    pages_per_seq = -(-context // page_size)
    pages = batch * pages_per_seq + 1
    generator = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    k_cache = torch.randn(
        pages * page_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=generator
    )
    v_cache = torch.randn_like(k_cache)
    # Pages scattered over the pool (page 0 is the engine's dummy page, never handed out).
    page_table = torch.randperm(pages - 1, device=device, generator=generator)[: batch * pages_per_seq] + 1
    page_table = page_table.view(batch, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    positions = seq_lens.long() - 1
    slots = (
        page_table.gather(1, (positions // page_size).view(-1, 1)).view(-1).long() * page_size + positions % page_size
    )
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=generator)
    k_new = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=generator)
    v_new = torch.randn_like(k_new)
    chosen_splits = splits or decode_splits(batch, KV_HEADS, device)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    rows = []
    for tile in tiles:

        def call(tile: DecodeTile = tile) -> None:
            paged_decode_attention_triton(
                q,
                k_cache,
                v_cache,
                page_table,
                seq_lens,
                page_size,
                HEAD_DIM**-0.5,
                splits=chosen_splits,
                new_kv=(k_new, v_new, slots),
                tile=tile,
            )

        if verbose:
            print(f"  batch {batch} context {context}: {vars(tile)}", flush=True)  # a crash names its tile
        try:
            us = graph_us([call])
        except OutOfResources as exc:  # a tile the compiler refuses (shared memory) is a result, not a crash
            rows.append({"tile": vars(tile), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        rows.append({"tile": vars(tile), "us": us, "tb_s": kv_bytes / (us * 1e-6) / 1e12})
    return rows, chosen_splits, kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32,128,256,512")
    parser.add_argument("--contexts", default="512,1024,7000")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--tiles",
        default="64x4x0,64x4x2,64x4x4,64x8x3,128x4x3,128x8x3,32x4x3,32x2x3,64x2x3",
        help="block_n x warps x stages, comma separated; the default tile is always run first",
    )
    parser.add_argument("--splits", type=int, default=None, help="fixed split count (default: the engine's choice)")
    parser.add_argument("--verbose", action="store_true", help="print each tile before it runs")
    parser.add_argument("--output", default="bench_results/attention_sweep.json")
    args = parser.parse_args()
    default = decode_tile(HEAD_DIM)
    tiles = [default] + [t for t in parse_tiles(args.tiles) if t != default]
    ceiling = copy_rate_bytes_per_s() / 1e12
    print(f"device copy: {ceiling:.2f} TB/s; default tile {vars(default)}")
    results = []
    print(f"{'batch':>6}{'context':>8}{'splits':>7}{'default us':>11}{'TB/s':>6}{'best us':>9}{'TB/s':>6}  best tile")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            case = decode_case(batch, context, args.page_size, tiles, args.splits, args.verbose)
            results.append(case)
            timed = [row for row in case["tiles"] if "us" in row]
            first, best = case["tiles"][0], min(timed, key=lambda row: row["us"])
            print(
                f"{batch:>6}{context:>8}{case['splits']:>7}{first.get('us', float('nan')):>11.1f}"
                f"{first.get('tb_s', float('nan')):>6.2f}{best['us']:>9.1f}{best['tb_s']:>6.2f}  {best['tile']}",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_tb_s": ceiling,
                "results": results,
            },
            handle,
            indent=1,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
