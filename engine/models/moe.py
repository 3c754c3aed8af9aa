"""Mixtral and Qwen3-MoE: the Llama block (Qwen3-MoE with q/k norms) with a sparse MoE MLP.

Checkpoints store each expert's projections apart (Mixtral:
`block_sparse_moe.experts.E.w1|w3|w2`, Qwen3-MoE: `mlp.experts.E.gate_proj|
up_proj|down_proj`), and the router as `block_sparse_moe.gate` / `mlp.gate`;
each lands in its slice of the stacked expert weights (engine/layers/moe.py).
A checkpoint that already stacks them (`mlp.experts.gate_up_proj`, as
transformers 5 holds them in memory) fills the whole parameter.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.models.llama import LlamaForCausalLM

# (layer, expert, projection) of a per-expert checkpoint tensor.
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
# projection -> (our stacked parameter, half of gate_up: 0 gate, 1 up; None: down)
_PROJECTIONS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


class MoEForCausalLM(LlamaForCausalLM):
    def _load_special(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> list[str] | None:
        if (router := _ROUTER.match(name)) is not None:
            name = f"model.layers.{router.group(1)}.mlp.gate.weight"  # Mixtral's router under our name
            param = self._param(params, name, name)
            self._copy(param.data, tensor, name)
            return [name]
        if (stacked := _STACKED.match(name)) is not None:
            param = self._param(params, name, name)
            self._copy(param.data, tensor, name)
            return self._expert_keys(name, param)
        match = _EXPERT.match(name)
        if match is None:
            return None
        layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
        ours, half = _PROJECTIONS[projection]
        target = f"model.layers.{layer}.mlp.experts.{ours}"
        param = self._param(params, target, name)
        if expert >= param.shape[0]:
            raise ModelLoadError(f"checkpoint tensor {name!r}: expert {expert} of {param.shape[0]}")
        dest = param.data[expert]
        if half is not None:
            size = self.config.moe_intermediate_size
            dest = dest[half * size : (half + 1) * size]
        self._copy(dest, tensor, name)
        return [f"{target}#{expert}" + ("" if half is None else f".{half}")]

    def _expected_fills(self, params: dict[str, nn.Parameter]) -> list[str]:
        expected = []
        for name in super()._expected_fills(params):
            if ".experts." in name:
                expected += self._expert_keys(name, params[name])
            else:
                expected.append(name)
        return expected

    @staticmethod
    def _expert_keys(name: str, param: nn.Parameter) -> list[str]:
        halves = [".0", ".1"] if name.endswith("gate_up_proj") else [""]
        return [f"{name}#{e}{h}" for e in range(param.shape[0]) for h in halves]

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        if target not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no matching parameter ({target})")
        return params[target]

    @staticmethod
    def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}")
        dest.copy_(tensor)
