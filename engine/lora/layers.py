"""LoRA inside the model's projections: every slot's A and B stacked, one-hot row masks picking each row's.

A projection with P parts (q/k/v: 3; gate/up: 2; o and down: 1) and S slots of rank up to R holds
lora_a [in, S*P*R] and lora_b [S*P*R, out]: for slot s and part p, columns (s*P + p)*R ... of A and the same
rows of B, whose only non-zero columns are part p's output rows (B carries the adapter's scaling). A batch
runs out = base(x) + ((x @ lora_a) * mask) @ lora_b, the mask keeping each row's slot's columns (none for a
base-model row). Two matmuls of width S*P*R whatever the mix of adapters (Punica's BGMV, densely): no
sorting by adapter, no host synchronisation, the same shapes every step. An empty slot is zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

from engine.layers.linear import Linear, LinearMethod

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # what a LoRA adapter can target
# The current step's row slots, one-hot [tokens, slots] in the model's dtype; None: no row uses an adapter.
_ROW_SLOTS: ContextVar[torch.Tensor | None] = ContextVar("lora_row_slots", default=None)


@contextlib.contextmanager
def lora_rows(one_hot: torch.Tensor | None) -> Iterator[None]:
    """Run the model with these rows' slots (a step's tokens, in order)."""
    token = _ROW_SLOTS.set(one_hot)
    try:
        yield
    finally:
        _ROW_SLOTS.reset(token)


class LoRALinearMethod:
    """The layer's own matmul, plus its rows' adapters."""

    name = "lora"

    def __init__(self, base: LinearMethod, parts: int, max_rank: int) -> None:
        self.base = base
        self.parts = parts
        self.max_rank = max_rank

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        rows = _ROW_SLOTS.get()
        if rows is None:
            return out
        slots = rows.shape[1]
        width = self.parts * self.max_rank
        mask = rows[:, :, None].expand(rows.shape[0], slots, width).reshape(rows.shape[0], slots * width)
        lora_a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
        lora_b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
        return out + ((x.to(lora_a.dtype) @ lora_a) * mask) @ lora_b


def add_lora_slots(layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
    """Give the projection its (empty) slots and the LoRA matmul."""
    parts = max(len(layer.part_rows), 1)
    width = max_loras * parts * max_rank
    device = layer.weight.device
    layer.register_buffer("lora_a", torch.zeros(layer.in_features, width, dtype=dtype, device=device))
    layer.register_buffer("lora_b", torch.zeros(width, layer.out_features, dtype=dtype, device=device))
    layer.method = LoRALinearMethod(layer.method, parts, max_rank)


def write_slot(
    layer: Linear, slot: int, max_rank: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None
) -> None:
    """Slot `slot` of the projection takes these parts' (A [r, in], B [rows, r]); None or a missing part: zeros."""
    parts = [str(part) for part in layer.part_rows] or [""]
    width = len(parts) * max_rank
    lora_a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
    lora_b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
    lora_a[:, slot * width : (slot + 1) * width].zero_()
    lora_b[slot * width : (slot + 1) * width].zero_()
    for index, part in enumerate(parts):
        pair = weights.get(part) if weights is not None else None
        if pair is None:
            continue
        a, b = pair
        rank = a.shape[0]
        start = slot * width + index * max_rank
        rows = layer.part_rows.get(part, (0, layer.out_features))
        lora_a[:, start : start + rank].copy_(a.t())
        lora_b[start : start + rank, rows[0] : rows[1]].copy_(b.t())


def lora_projections(model: nn.Module) -> dict[tuple[int, str], Linear]:
    """(layer index, our projection name) -> the Linear, for every projection LoRA can target."""
    found = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if (
            isinstance(module, Linear)
            and "layers" in parts
            and parts[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        ):
            found[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found
