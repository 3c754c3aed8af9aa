"""LoRA inside the model's projections: every slot's A and B stacked per slot, each token row using its own.

A projection with P parts (q/k/v: 3; gate/up: 2; o and down: 1) and S slots of rank up to R holds
lora_a [S, P*R, in] and lora_b [S, P*R, out]: slot s's rows p*R ... p*R + r of A are part p's A (rank r,
zero-padded to R), and the same rows of B hold part p's B in part p's output columns only, with the
adapter's scaling folded in. So one shrink and one expand of width P*R serve every part at once, and a row's
slot is all a kernel needs to find its matrices (engine/lora/matmul.py: the dense torch path, or a platform's
kernel that reads only each row's slot, CUDA's grouped Triton kernels, which add into the base output in
place). The shapes never change with the mix of adapters and nothing is synchronised with the host, so the
captured graphs (CUDA graphs, the CPU's compiled steps) run it as they run the rest. An empty slot is zeros.

Each token's slot is read from buffers every projection shares (engine/lora/rows.py, -1: the base model), which
the model runner fills before a step as it fills the step's other inputs; the rows a graph pads with stay -1.

Under tensor parallelism each rank holds its shard of the slots, cut as the base weight is: a column-parallel
projection (q/k/v, gate/up) keeps A whole and its rows of each part's B; a row-parallel one (o, down) keeps
its input columns of A and B whole, its partial product summed by the layer's all-reduce with the base's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import ColumnParallelLinear, Linear, LinearMethod, RowParallelLinear
from engine.lora.matmul import LoRAKernels, TokenSlots
from engine.lora.rows import LoRARows

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # what a LoRA adapter can target


class LoRALinearMethod:
    """The layer's own matmul, plus its tokens' adapters."""

    name = "lora"

    def __init__(self, base: LinearMethod, kernels: LoRAKernels) -> None:
        self.base = base
        self.kernels = kernels

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        lora_a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
        lora_b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
        slots: torch.Tensor = layer.lora_token_slots  # type: ignore[assignment]
        sorted_rows: torch.Tensor = layer.lora_sorted_rows  # type: ignore[assignment]
        group_starts: torch.Tensor = layer.lora_group_starts  # type: ignore[assignment]
        return self.kernels.apply(out, x, lora_a, lora_b, TokenSlots(slots[: x.shape[0]], sorted_rows, group_starts))


def part_names(layer: Linear) -> list[str]:
    """The projection's parts in their order in the stacks ("" for a projection of one part)."""
    return [str(part) for part in layer.part_rows] or [""]


def add_lora_slots(layer: Linear, rows: LoRARows, max_rank: int, dtype: torch.dtype, kernels: LoRAKernels) -> None:
    """Give the projection its (empty) slots, the shared token -> slot buffer, and the LoRA matmul."""
    width = len(part_names(layer)) * max_rank
    device = layer.weight.device
    shape = (rows.num_slots, width)
    layer.register_buffer("lora_a", torch.zeros(*shape, layer.in_features, dtype=dtype, device=device))
    layer.register_buffer("lora_b", torch.zeros(*shape, layer.out_features, dtype=dtype, device=device))
    layer.register_buffer("lora_token_slots", rows.slots, persistent=False)
    layer.register_buffer("lora_sorted_rows", rows.sorted_rows, persistent=False)
    layer.register_buffer("lora_group_starts", rows.group_starts, persistent=False)
    layer.method = LoRALinearMethod(layer.method, kernels)


def full_shape(layer: Linear, part: str) -> tuple[int, int]:
    """(output rows of the part, input columns) in the whole model, as an adapter's B and A have them."""
    in_features = layer.input_shard.total if isinstance(layer, RowParallelLinear) else layer.in_features
    if isinstance(layer, ColumnParallelLinear):
        return layer.shards[part].total, in_features
    rows = layer.part_rows.get(part, (0, layer.out_features))
    return rows[1] - rows[0], in_features


def rank_shard(layer: Linear, part: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece of a part's (A [r, in], B [rows, r]), cut as the layer's weight is cut."""
    if isinstance(layer, ColumnParallelLinear):
        shard = layer.shards[part]
        return a, b[shard.start : shard.start + shard.size]
    if isinstance(layer, RowParallelLinear):
        shard = layer.input_shard
        return a[:, shard.start : shard.start + shard.size], b
    return a, b


def write_slot(
    layer: Linear, slot: int, max_rank: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None
) -> None:
    """Slot `slot` of the projection takes these parts' (A [r, in], B [rows, r]), whole-model shapes, cut here
    for this rank; None or a missing part: zeros."""
    lora_a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
    lora_b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
    lora_a[slot].zero_()
    lora_b[slot].zero_()
    for index, part in enumerate(part_names(layer)):
        pair = weights.get(part) if weights is not None else None
        if pair is None:
            continue
        a, b = rank_shard(layer, part, *pair)
        rank = a.shape[0]
        start = index * max_rank
        rows = layer.part_rows.get(part, (0, layer.out_features))
        lora_a[slot, start : start + rank].copy_(a)
        lora_b[slot, start : start + rank, rows[0] : rows[1]].copy_(b.t())


def lora_projections(model: nn.Module) -> dict[tuple[int, str], Linear]:
    """(layer index, our projection name) -> the Linear, for every projection LoRA can target."""
    found = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, Linear) and "layers" in parts and parts[-1] in PROJECTIONS:
            found[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found
