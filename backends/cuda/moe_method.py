"""The CUDA/ROCm experts method: the fused Triton MoE (backends/cuda/triton_moe.py) as an opaque op.

Registered as `engine::fused_moe` so that torch.compile sees one opaque call
with a fake for shapes (as the attention ops), and CUDA graph capture records
its kernels. The platform's prepare_model switches every SparseMoE to it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe import SparseMoE
from engine.layers.ops import define_op


def _fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    from backends.cuda.triton_moe import fused_moe

    return fused_moe(hidden, gate_up, down, expert_ids, weights)


def _fused_moe_fake(hidden, gate_up, down, expert_ids, weights):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden)


define_op(
    "fused_moe",
    "(Tensor hidden, Tensor gate_up, Tensor down, Tensor expert_ids, Tensor weights) -> Tensor",
    _fused_moe,
    _fused_moe_fake,
)


class TritonFusedMoEMethod:
    name = "triton_fused"
    capturable = True

    def apply(self, layer: SparseMoE, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.engine.fused_moe(hidden, layer.experts.gate_up_proj, layer.experts.down_proj, expert_ids, weights)


TRITON_FUSED_MOE = TritonFusedMoEMethod()


def use_fused_moe(model: nn.Module) -> int:
    """Every SparseMoE of the model runs the fused Triton kernel; returns how many layers switched."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for layer in layers:
        layer.method = TRITON_FUSED_MOE
    return len(layers)
