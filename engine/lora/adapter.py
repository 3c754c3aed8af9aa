"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`), read and checked against
the base model: which projections it targets, their A and B matrices per layer, and its scaling."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

# PEFT's module names -> (our fused projection, its part); a part "" is the whole projection.
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", ""),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", ""),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """weights[(layer, peft module)] = (A [rank, in], B [out, rank] with the scaling folded in)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def load_adapter(name: str, path: str, max_rank: int, num_layers: int) -> LoRAAdapter:
    """Read and check the folder; every problem is an InvalidRequestError naming it (nothing is half-loaded)."""
    from safetensors.torch import load_file

    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise InvalidRequestError(
            f"LoRA adapter {name!r}: {path} is not a PEFT adapter folder (adapter_config.json and "
            "adapter_model.safetensors)"
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        tensors = load_file(weights_path)
    except Exception as exc:  # a corrupt JSON or safetensors file, whatever the library raised
        raise InvalidRequestError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "use_qalora"):
        if config.get(flag):
            raise InvalidRequestError(f"LoRA adapter {name!r}: {flag} is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise InvalidRequestError(f"LoRA adapter {name!r}: bias training and modules_to_save are not supported")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise InvalidRequestError(f"LoRA adapter {name!r}: per-module ranks or alphas are not supported")
    if rank > max_rank:
        raise InvalidRequestError(f"LoRA adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise InvalidRequestError(f"LoRA adapter {name!r}: unexpected tensor {key}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGETS:
            raise InvalidRequestError(
                f"LoRA adapter {name!r}: module {module} is not a target the engine applies ({', '.join(TARGETS)})"
            )
        if layer >= num_layers:
            raise InvalidRequestError(f"LoRA adapter {name!r}: layer {layer}, but the base model has {num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    weights = {}
    for where, pair in halves.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise InvalidRequestError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]} lacks A or B of rank {rank}")
        weights[where] = (pair["A"], pair["B"] * scaling)
    if not weights:
        raise InvalidRequestError(f"LoRA adapter {name!r}: no LoRA weights in {weights_path}")
    return LoRAAdapter(name, path, rank, weights)
