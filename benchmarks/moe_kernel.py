"""The MoE experts of one layer on a GPU: the fused Triton kernels against the torch path and the bytes floor.

    PYTHONPATH=. python benchmarks/moe_kernel.py --models qwen3-30b-a3b,mixtral-8x7b --tokens 1,32,128 \
        --sweep --output bench_results/moe_kernel.json

For each model preset (configs/models/<name>.json: experts, top k, hidden and expert intermediate sizes)
and token count T, a random routing (top k of a softmax over random logits, renormalised) over
`--layers` distinct copies of the layer's expert weights in bf16, so that the weights are read from
memory as in a model and not from L2. Timed per layer:

- `fused`: backends.cuda.triton_moe.fused_moe with the tile the engine picks for T (moe_tile), replayed
  from a CUDA graph holding all the layers (as the decode graphs run it);
- `sweep` (with --sweep): the same for every candidate tile, grouped (BLOCK_M 16/64) and per slot;
- `torch`: engine.layers.moe.moe_experts, the CPU's path (it loops over the experts hit, reading the
  routing on the host: eager, not capturable);
- `floor`: the bytes of the experts the routing touches (gate, up and down of each distinct expert)
  at the copy rate measured in the same run (a 4 GiB device-to-device copy, read + write bytes).

Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from backends.cuda.triton_moe import MoeTile, fused_moe, moe_tile
from benchmarks.gpu_timing import copy_rate_bytes_per_s, graph_us, preset_config
from engine.layers.moe import moe_experts
from engine.tuning.measure import steady_ms

SWEEP_TILES = (
    [MoeTile(16, n, k, num_warps=4, num_stages=s) for n in (32, 64) for k in (64, 128) for s in (3, 4)]
    + [MoeTile(64, 64, 64, num_warps=4, num_stages=3), MoeTile(64, 128, 64, num_warps=8, num_stages=3)]
    + [
        MoeTile(1, n, k, num_warps=w, num_stages=2, per_slot=True)
        for n in (8, 16, 32, 64)
        for k in (128, 256, 512)
        for w in (4, 8)
        if n * k <= 16384
    ]
)


def preset(name: str) -> dict[str, int]:
    config = preset_config(name)
    return {
        "experts": config.get("num_experts", config.get("num_local_experts")),
        "top_k": config["num_experts_per_tok"],
        "hidden": config["hidden_size"],
        "inter": config.get("moe_intermediate_size", config["intermediate_size"]),
    }


def graph_ms_per_layer(fn: Callable[[int], object], layers: int) -> float:
    """fn(layer) for every layer, captured once in a CUDA graph; ms per layer of a replay."""
    return graph_us([lambda layer=layer: fn(layer) for layer in range(layers)], replays=30) / 1e3


def measure(name: str, tokens: int, layers: int, sweep: bool, rate: float) -> dict[str, Any]:
    shape = preset(name)
    experts, top_k, hidden, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    to = {"device": "cuda", "dtype": torch.bfloat16}
    gate_ups = [
        torch.randn(experts, 2 * inter, hidden, generator=generator, **to) * hidden**-0.5 for _ in range(layers)
    ]
    downs = [torch.randn(experts, hidden, inter, generator=generator, **to) * inter**-0.5 for _ in range(layers)]
    x = torch.randn(tokens, hidden, generator=generator, **to)
    logits = torch.randn(tokens, experts, generator=generator, device="cuda")
    weights, expert_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    distinct = int(torch.unique(expert_ids).numel())
    floor_ms = distinct * 3 * hidden * inter * 2 / rate * 1e3

    def run(tile: MoeTile) -> Callable[[int], object]:
        return lambda layer: fused_moe(x, gate_ups[layer], downs[layer], expert_ids, weights, tile=tile)

    want = moe_experts(x.float(), gate_ups[0].float(), downs[0].float(), expert_ids, weights.float())
    default = moe_tile(tokens, top_k, experts, torch.bfloat16)
    row: dict[str, Any] = {
        "model": name,
        "tokens": tokens,
        **shape,
        "distinct_experts": distinct,
        "floor_ms": floor_ms,
        "default_tile": asdict(default),
    }
    row["fused_ms"] = graph_ms_per_layer(run(default), layers)
    row["fused_max_abs_err"] = float(
        (fused_moe(x, gate_ups[0], downs[0], expert_ids, weights).float() - want).abs().max()
    )
    torch_call = lambda: [moe_experts(x, gate_ups[layer], downs[layer], expert_ids, weights) for layer in range(layers)]  # noqa: E731
    row["torch_ms"] = steady_ms(torch.cuda.synchronize, torch_call, 10) / layers
    if sweep:
        row["sweep"] = []
        for tile in SWEEP_TILES:
            try:
                err = float(
                    (fused_moe(x, gate_ups[0], downs[0], expert_ids, weights, tile=tile).float() - want).abs().max()
                )
                row["sweep"].append(
                    {"tile": asdict(tile), "ms": graph_ms_per_layer(run(tile), layers), "max_abs_err": err}
                )
            except Exception as error:
                row["sweep"].append({"tile": asdict(tile), "error": f"{type(error).__name__}: {str(error)[:200]}"})
    return row


def tile_text(tile: dict[str, Any]) -> str:
    kind = "slot" if tile["per_slot"] else f"m{tile['block_m']}"
    return f"{kind} n{tile['block_n']} k{tile['block_k']} w{tile['num_warps']} s{tile['num_stages']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,32,128")
    parser.add_argument("--layers", type=int, default=4, help="distinct weight copies per graph (bytes past L2)")
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile too")
    parser.add_argument("--output", default="bench_results/moe_kernel.json")
    args = parser.parse_args()
    rate = copy_rate_bytes_per_s()
    print(f"{torch.cuda.get_device_name()}: copy rate {rate / 1e12:.2f} TB/s (read + write)")
    rows = []
    print(
        f"{'model':>15} {'T':>5} {'experts':>7} {'floor':>7} {'fused':>7} {'torch':>7} {'fused/floor':>11}  "
        "best tile (ms)"
    )
    for name in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = measure(name, tokens, args.layers, args.sweep, rate)
            torch.cuda.empty_cache()  # the case's weights are freed with measure's frame
            rows.append(row)
            timed = [s for s in row.get("sweep", []) if "ms" in s]
            best = min(timed, key=lambda s: s["ms"]) if timed else None
            best_text = f"{tile_text(best['tile'])} ({best['ms']:.4f})" if best else ""
            print(
                f"{name:>15} {tokens:5d} {row['distinct_experts']:7d} {row['floor_ms']:7.4f} {row['fused_ms']:7.4f} "
                f"{row['torch_ms']:7.4f} {row['fused_ms'] / row['floor_ms']:11.2f}  {best_text}",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_rate_bytes_per_s": rate,
                "layers": args.layers,
                "rows": rows,
            },
            handle,
            indent=1,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
