"""Which adapters are loaded, which of them sit in a device slot; loading and unloading at run time.

Two tiers, as vLLM's `--max-loras` and `--max-cpu-loras`: up to max_cpu_loras adapters are loaded (read,
checked and kept in host memory), and up to max_loras of them are resident in a device slot (their weights
copied into every targeted projection's slot columns). A request's adapter is made resident when it is
scheduled: into a free slot, or into the least recently used one that no live request uses; when every slot
is used, the request waits (the engine retries it each step). Unloading is refused while a request uses the
adapter; a load beyond max_cpu_loras is refused with the fix in the message.

Under tensor parallelism rank 0's manager decides (it owns the requests) and every change of a slot's
contents is handed to `on_change` as a `SlotChange`, which the engine sends to the other ranks before their
next step; their managers apply it with `apply_change`, reading the adapter's folder themselves (the ranks
share a host) and keeping their shard of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import InvalidRequestError
from engine.layers.linear import Linear
from engine.lora.adapter import TARGETS, LoRAAdapter, load_adapter
from engine.lora.layers import add_lora_slots, full_shape, lora_projections, write_slot
from engine.lora.matmul import DENSE_LORA, LoRAKernels
from engine.lora.rows import LoRARows

ProjectionWeights = dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class SlotChange:
    """What another rank must do to hold rank 0's slots: `name` (from `path`) into `slot`, or, with name
    None, forget `unloaded` (and empty its slot, if it had one)."""

    slot: int | None
    name: str | None
    path: str = ""
    unloaded: str | None = None


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        max_tokens: int,
        device: torch.device,
        max_cpu_loras: int | None = None,
        kernels: LoRAKernels = DENSE_LORA,
    ) -> None:
        """max_tokens: the most tokens a step runs (its rows of the token -> slot buffer); max_cpu_loras:
        adapters kept loaded in host memory (at least max_loras; None: max_loras); kernels: the batched LoRA
        matmul of the platform (Platform.lora_kernels(); the dense torch path when it has none)."""
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.max_rank = max_rank
        self.projections: dict[tuple[int, str], Linear] = lora_projections(model)
        if not self.projections:
            raise ValueError("LoRA: this model has no projection LoRA can target")
        self.rows = LoRARows(max_tokens, max_loras, device, grouped=kernels.grouped)
        for layer in self.projections.values():
            add_lora_slots(layer, self.rows, max_rank, dtype, kernels)
        self.kernels = kernels
        self.num_layers = 1 + max(index for index, _ in self.projections)
        self.adapters: dict[str, LoRAAdapter] = {}  # loaded (host memory)
        self.weights: dict[str, ProjectionWeights] = {}
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident: name -> slot, least recently used first
        self.on_change: Callable[[SlotChange], None] | None = None  # rank 0 under tensor parallelism

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and check against the base model, keep in host memory, and make resident if a slot is free;
        nothing changes if any step fails."""
        if name in self.adapters:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path})")
        if len(self.adapters) >= self.max_cpu_loras:
            loaded = ", ".join(sorted(self.adapters))
            raise InvalidRequestError(
                f"LoRA adapter {name!r}: {self.max_cpu_loras} adapters are loaded ({loaded}); "
                "unload one or raise --max-cpu-loras"
            )
        self._read(name, path)
        self.make_resident(name, busy=set(self.slots))  # a free slot, if there is one; else on first use
        return self.adapters[name]

    def _read(self, name: str, path: str) -> None:
        """Read and check the folder against the (whole) base model and keep it in host memory."""
        adapter = load_adapter(name, path, self.max_rank, self.num_layers)
        by_projection: ProjectionWeights = {}
        for (layer_index, module), (a, b) in adapter.weights.items():
            projection, part = TARGETS[module]
            layer = self.projections.get((layer_index, projection))
            if layer is None:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r}: the base model has no {module} in layer {layer_index}"
                )
            rows, in_features = full_shape(layer, part)
            if a.shape[1] != in_features or b.shape[0] != rows:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r}: layer {layer_index} {module} is {b.shape[0]} x {a.shape[1]}, the base "
                    f"model's is {rows} x {in_features}: an adapter of another base model"
                )
            by_projection.setdefault((layer_index, projection), {})[part] = (a, b)
        self.adapters[name] = adapter
        self.weights[name] = by_projection

    def unload(self, name: str) -> None:
        """Forget the adapter and empty its slot (the caller refuses while requests use it)."""
        if name not in self.adapters:
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded")
        del self.adapters[name], self.weights[name]
        slot = self.slots.pop(name, None)
        if slot is not None:
            self._write(slot, None)
        if self.on_change is not None:
            self.on_change(SlotChange(slot, None, unloaded=name))

    def check_loaded(self, name: str) -> None:
        if name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")

    def make_resident(self, name: str, busy: set[str]) -> int | None:
        """The adapter's device slot, copying it in if need be: into a free slot, else over the least recently
        used resident adapter not in `busy` (the adapters live requests use). None: every slot is busy."""
        self.check_loaded(name)
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        taken = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((other for other in self.slots if other not in busy), None)
            if victim is None:
                return None
            slot = self.slots.pop(victim)
        self._write(slot, self.weights[name])
        self.slots[name] = slot
        if self.on_change is not None:
            self.on_change(SlotChange(slot, name, self.adapters[name].path))
        return slot

    def apply_change(self, change: SlotChange) -> None:
        """Another rank: hold what rank 0's manager decided (its slots stay rank 0's exactly)."""
        if change.name is None:
            if change.unloaded in self.adapters:
                self.unload(change.unloaded)
            elif change.slot is not None:
                self._write(change.slot, None)
            return
        assert change.slot is not None
        if change.name not in self.adapters:
            self._read(change.name, change.path)
        for other, slot in list(self.slots.items()):
            if slot == change.slot or other == change.name:
                del self.slots[other]
        self._write(change.slot, self.weights[change.name])
        self.slots[change.name] = change.slot

    def _write(self, slot: int, weights: ProjectionWeights | None) -> None:
        for key, layer in self.projections.items():
            write_slot(layer, slot, self.max_rank, weights.get(key) if weights is not None else None)
