"""The gated MLP every family here uses: down(act(gate(x)) * up(x)), gate and up in one fused matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.sharding import even_shard
from engine.distributed.state import tp_state
from engine.errors import ModelLoadError
from engine.layers.linear import column_parallel_linear, row_parallel_linear


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF activation names -> functions (transformers' ACT2FN names).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
}


class GatedMLP(nn.Module):
    """With tensor parallelism each rank holds its share of the intermediate dimension (gate/up
    column-parallel, down row-parallel); reduce_output=False leaves the sum over ranks to the caller
    (Qwen2-MoE's shared expert, summed with the routed experts in one all-reduce)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str = "silu", reduce_output: bool = True
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[activation]
        state = tp_state()
        intermediate = even_shard(intermediate_size, state.rank, state.world_size, "MLP intermediate size")
        self.intermediate_size = intermediate.size
        self.gate_up_proj = column_parallel_linear(hidden_size, [("gate", intermediate), ("up", intermediate)])
        self.down_proj = row_parallel_linear(intermediate, hidden_size, reduce_results=reduce_output)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
