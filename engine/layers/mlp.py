"""The gated MLP every family here uses: down(act(gate(x)) * up(x)), gate and up in one fused matmul."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.linear import Linear


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF activation names -> functions (transformers' ACT2FN names).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu_tanh": gelu_tanh,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[activation]
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False,
                                   parts=[("gate", intermediate_size), ("up", intermediate_size)])
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
