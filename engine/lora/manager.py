"""Which adapters are loaded, in which device slot; loading and unloading at run time.

`max_loras` slots: an adapter takes a free one when it is loaded (its weights copied into every targeted
projection's slot) and gives it back when it is unloaded, which is refused while a request uses it. A load
that finds no free slot is refused with the fix in the message (unload one, or raise --max-loras).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import InvalidRequestError
from engine.layers.linear import Linear
from engine.lora.adapter import TARGETS, LoRAAdapter, load_adapter
from engine.lora.layers import LoRARows, add_lora_slots, lora_projections, write_slot


class LoRAManager:
    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, max_tokens: int, device: torch.device
    ) -> None:
        """max_tokens: the most tokens a step runs (its rows of the token -> slot buffer)."""
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.projections: dict[tuple[int, str], Linear] = lora_projections(model)
        if not self.projections:
            raise ValueError("LoRA: this model has no projection LoRA can target")
        self.rows = LoRARows(max_tokens, max_loras, device)
        for layer in self.projections.values():
            add_lora_slots(layer, self.rows, max_rank, dtype)
        self.num_layers = 1 + max(index for index, _ in self.projections)
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.adapters: dict[str, LoRAAdapter] = {}

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read, check against the base model, and copy into a free slot; nothing changes if any step fails."""
        if name in self.adapters:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path})")
        free = [s for s in range(self.max_loras) if s not in self.slots.values()]
        if not free:
            raise InvalidRequestError(
                f"LoRA adapter {name!r}: all {self.max_loras} slots are taken ({', '.join(sorted(self.slots))}); "
                "unload one or raise --max-loras"
            )
        adapter = load_adapter(name, path, self.max_rank, self.num_layers)
        by_projection: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer_index, module), (a, b) in adapter.weights.items():
            projection, part = TARGETS[module]
            layer = self.projections.get((layer_index, projection))
            if layer is None:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r}: the base model has no {module} in layer {layer_index}"
                )
            rows = layer.part_rows.get(part, (0, layer.out_features))
            if a.shape[1] != layer.in_features or b.shape[0] != rows[1] - rows[0]:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r}: layer {layer_index} {module} is {b.shape[0]} x {a.shape[1]}, the base "
                    f"model's is {rows[1] - rows[0]} x {layer.in_features}: an adapter of another base model"
                )
            by_projection.setdefault((layer_index, projection), {})[part] = (a, b)
        slot = free[0]
        for key, layer in self.projections.items():
            write_slot(layer, slot, self.max_rank, by_projection.get(key))
        self.slots[name] = slot
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Empty the adapter's slot (the caller refuses while requests use it)."""
        if name not in self.slots:
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded")
        slot = self.slots.pop(name)
        del self.adapters[name]
        for layer in self.projections.values():
            write_slot(layer, slot, self.max_rank, None)

    def slot_of(self, name: str) -> int:
        if name not in self.slots:
            loaded = ", ".join(sorted(self.slots)) or "none"
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return self.slots[name]
