"""LoRA inside the model's projections: every slot's A and B stacked per slot, each token row using its own.

A projection with P parts (q/k/v: 3; gate/up: 2; o and down: 1) and S slots of rank up to R holds
lora_a [S, P*R, in] and lora_b [S, P*R, out]: slot s's rows p*R ... p*R + r of A are part p's A (rank r,
zero-padded to R), and the same rows of B hold part p's B in part p's output columns only, with the
adapter's scaling folded in. So one shrink and one expand of width P*R serve every part at once, and a row's
slot is all a kernel needs to find its matrices (engine/lora/matmul.py: the dense torch path, or a platform's
kernel that reads only each row's slot, CUDA's grouped Triton kernels, which add into the base output in
place). The shapes never change with the mix of adapters and nothing is synchronised with the host, so the
captured graphs (CUDA graphs, the CPU's compiled steps) run it as they run the rest. An empty slot is zeros.

Where the base matmul reads a plain weight and the slots' rows are few next to it (`can_fold`), A is folded
into the base weight: one weight [out + S*K, in], the layer's `weight` a view of its first rows and `lora_a` of
the rest, so one matmul makes the base output and every slot's low-rank columns, and only the expand runs.

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


FOLD_MAX_FRACTION = 8
"""A into the base weight only while every slot's rows add at most 1/8 of the projection's own (Llama-3-8B,
8 slots of rank 16: 1/16 for q/k/v, 1/112 for gate/up): every token computes every slot's low-rank columns
there, work that grows with the slots, where the shrink kernel reads only each row's own slot."""


class LoRALinearMethod:
    """The layer's own matmul, plus its tokens' adapters."""

    name = "lora"

    def __init__(self, base: LinearMethod, kernels: LoRAKernels, folded: bool) -> None:
        """folded: A is folded into the base weight (`lora_folded_weight`), and `base` is a WeightMatmul."""
        self.base = base
        self.kernels = kernels
        self.folded = folded

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        lora_b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
        slots: torch.Tensor = layer.lora_token_slots  # type: ignore[assignment]
        sorted_rows: torch.Tensor = layer.lora_sorted_rows  # type: ignore[assignment]
        group_starts: torch.Tensor = layer.lora_group_starts  # type: ignore[assignment]
        rows = TokenSlots(slots[: x.shape[0]], sorted_rows, group_starts)
        if self.folded:
            # One matmul makes the base output and every slot's low-rank columns side by side; the expand adds
            # each row's own slot's product into the base columns (a view: no copy of either part).
            folded_weight: torch.Tensor = layer.lora_folded_weight  # type: ignore[assignment]
            folded_bias: torch.Tensor | None = layer.lora_folded_bias  # type: ignore[assignment]
            both = self.base.matmul(x, folded_weight, folded_bias)  # type: ignore[attr-defined]
            out_features = layer.weight.shape[0]
            return self.kernels.expand(both[..., :out_features], both[..., out_features:], lora_b, rows)
        lora_a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
        return self.kernels.apply(self.base.apply(layer, x), x, lora_a, lora_b, rows)


def part_names(layer: Linear) -> list[str]:
    """The projection's parts in their order in the stacks ("" for a projection of one part)."""
    return [str(part) for part in layer.part_rows] or [""]


def add_lora_slots(layer: Linear, rows: LoRARows, max_rank: int, dtype: torch.dtype, kernels: LoRAKernels) -> None:
    """Give the projection its (empty) slots, the shared token -> slot buffer, and the LoRA matmul: A folded into
    the base weight where `can_fold` says so, else a stack of its own."""
    width = len(part_names(layer)) * max_rank
    device = layer.weight.device
    shape = (rows.num_slots, width)
    folded = can_fold(layer, rows.num_slots * width, dtype)
    if folded:
        fold_lora_a(layer, rows.num_slots, width)
    else:
        layer.register_buffer("lora_a", torch.zeros(*shape, layer.in_features, dtype=dtype, device=device))
    layer.register_buffer("lora_b", torch.zeros(*shape, layer.out_features, dtype=dtype, device=device))
    layer.register_buffer("lora_token_slots", rows.slots, persistent=False)
    layer.register_buffer("lora_sorted_rows", rows.sorted_rows, persistent=False)
    layer.register_buffer("lora_group_starts", rows.group_starts, persistent=False)
    layer.method = LoRALinearMethod(layer.method, kernels, folded)


def can_fold(layer: Linear, lora_rows: int, dtype: torch.dtype) -> bool:
    """Whether the layer's matmul can make A's low-rank rows with its own product: its method reads the weight
    tensor as given (a WeightMatmul; not a packed or quantized copy), of LoRA's dtype, and every slot's rows
    are few next to the weight's (FOLD_MAX_FRACTION)."""
    weight = layer.weight
    return (
        callable(getattr(layer.method, "matmul", None))
        and weight.dim() == 2
        and weight.dtype == dtype
        and lora_rows * FOLD_MAX_FRACTION <= weight.shape[0]
    )


@torch.no_grad()
def fold_lora_a(layer: Linear, num_slots: int, width: int) -> None:
    """One weight [out + S*K, in]: the base weight's rows, then every slot's A (zeros: empty slots). The layer's
    `weight` (and `bias`) become views of its first rows, so the base model reads what it read before, and
    `lora_a` [S, K, in] a view of the rest, which write_slot fills."""
    weight = layer.weight
    out_features, in_features = weight.shape
    folded = torch.zeros(out_features + num_slots * width, in_features, dtype=weight.dtype, device=weight.device)
    folded[:out_features].copy_(weight)
    weight.data = folded[:out_features]
    layer.register_buffer("lora_folded_weight", folded, persistent=False)
    layer.register_buffer("lora_a", folded[out_features:].view(num_slots, width, in_features), persistent=False)
    folded_bias = None
    if layer.bias is not None:
        folded_bias = torch.zeros(folded.shape[0], dtype=layer.bias.dtype, device=layer.bias.device)
        folded_bias[:out_features].copy_(layer.bias)
        layer.bias.data = folded_bias[:out_features]
    layer.register_buffer("lora_folded_bias", folded_bias, persistent=False)


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
