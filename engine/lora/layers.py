"""LoRA inside the model's projections: every slot's A and B stacked, each token's slot picking its columns.

A projection with P parts (q/k/v: 3; gate/up: 2; o and down: 1) and S slots of rank up to R holds
lora_a [in, S*P*R] and lora_b [S*P*R, out]: for slot s and part p, columns (s*P + p)*R ... of A and the same
rows of B, whose only non-zero columns are part p's output rows (B carries the adapter's scaling). A step runs
out = base(x) + ((x @ lora_a) * mask) @ lora_b, the mask keeping each token's slot's columns (none for a
base-model token). Two matmuls of width S*P*R whatever the mix of adapters (Punica's BGMV, densely): no
sorting by adapter, no host synchronisation, the same shapes every step, so the captured graphs (CUDA graphs,
the CPU's compiled steps) run it as they run the rest. An empty slot is zeros.

Each token's slot is read from one buffer every projection shares (`LoRARows`, -1: the base model), which the
model runner fills before a step as it fills the step's other inputs; the rows a graph pads with stay -1.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear, LinearMethod

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # what a LoRA adapter can target


class LoRARows:
    """The step's token -> slot map, on the device, shared by every LoRA projection."""

    def __init__(self, max_tokens: int, slots: int, device: torch.device) -> None:
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.slot_ids = torch.arange(slots, dtype=torch.int64, device=device)
        self._filled = 0  # tokens written by the last step, reset to -1 by the next

    def fill(self, token_slots: torch.Tensor) -> None:
        """This step's slots (the first len(token_slots) tokens); the rest, padding included, -1."""
        n = token_slots.shape[0]
        if n > self.slots.shape[0]:
            raise ValueError(f"a step of {n} tokens; the LoRA rows hold {self.slots.shape[0]}")
        self.slots[:n].copy_(token_slots)
        if self._filled > n:
            self.slots[n : self._filled].fill_(-1)
        self._filled = n


class LoRALinearMethod:
    """The layer's own matmul, plus its tokens' adapters."""

    name = "lora"

    def __init__(self, base: LinearMethod, parts: int, max_rank: int) -> None:
        self.base = base
        self.parts = parts
        self.max_rank = max_rank

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        lora_a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
        lora_b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
        slots: torch.Tensor = layer.lora_token_slots  # type: ignore[assignment]
        slot_ids: torch.Tensor = layer.lora_slot_ids  # type: ignore[assignment]
        mask = (slots[: x.shape[0]].unsqueeze(1) == slot_ids).to(lora_a.dtype)  # [tokens, S]
        mask = mask.repeat_interleave(self.parts * self.max_rank, dim=1)  # [tokens, S*P*R]
        return out + (((x.to(lora_a.dtype) @ lora_a) * mask) @ lora_b).to(out.dtype)


def add_lora_slots(layer: Linear, rows: LoRARows, max_rank: int, dtype: torch.dtype) -> None:
    """Give the projection its (empty) slots, the shared token -> slot buffer, and the LoRA matmul."""
    parts = max(len(layer.part_rows), 1)
    width = rows.slot_ids.shape[0] * parts * max_rank
    device = layer.weight.device
    layer.register_buffer("lora_a", torch.zeros(layer.in_features, width, dtype=dtype, device=device))
    layer.register_buffer("lora_b", torch.zeros(width, layer.out_features, dtype=dtype, device=device))
    layer.register_buffer("lora_token_slots", rows.slots, persistent=False)
    layer.register_buffer("lora_slot_ids", rows.slot_ids, persistent=False)
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
