"""The CUDA/ROCm experts method: the fused Triton MoE (backends/cuda/triton_moe.py) as opaque ops.

Registered as `engine::fused_moe_slots` and `engine::moe_route` so that torch.compile sees opaque
calls with fakes for shapes (as the attention ops), and CUDA graph capture records their kernels.
The experts op returns each token slot's weighted output [T, k, H]; the sum over a token's k slots
is left to the compiled step, where inductor folds it into the residual add that follows rather
than spending a launch on it. The platform's prepare_model switches every SparseMoE to it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe import SparseMoE
from engine.layers.ops import define_op


def _fused_moe_slots(
    hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    from backends.cuda.triton_moe import fused_moe

    return fused_moe(hidden, gate_up, down, expert_ids, weights, sum_slots=False)


def _fused_moe_slots_fake(hidden, gate_up, down, expert_ids, weights):
    return hidden.new_empty(hidden.shape[0], expert_ids.shape[1], hidden.shape[1])


def _moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from backends.cuda.triton_moe import moe_route

    return moe_route(logits, top_k, renormalize)


def _moe_route_fake(logits, top_k, renormalize):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.int32), logits.new_empty(shape, dtype=torch.float32)


define_op(
    "fused_moe_slots",
    "(Tensor hidden, Tensor gate_up, Tensor down, Tensor expert_ids, Tensor weights) -> Tensor",
    _fused_moe_slots,
    _fused_moe_slots_fake,
)
define_op("moe_route", "(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor)", _moe_route, _moe_route_fake)


class TritonFusedMoEMethod:
    name = "triton_fused"
    capturable = True

    def select_experts(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.engine.moe_route(logits, top_k, renormalize)

    def apply(
        self, layer: SparseMoE, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        slots = torch.ops.engine.fused_moe_slots(
            hidden, layer.experts.gate_up_proj, layer.experts.down_proj, expert_ids, weights
        )
        return slots.sum(dim=1) if slots.shape[1] > 1 else slots.squeeze(1)


TRITON_FUSED_MOE = TritonFusedMoEMethod()


def use_fused_moe(model: nn.Module) -> int:
    """Every SparseMoE of the model runs the fused Triton kernels; returns how many layers switched."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for layer in layers:
        layer.method = TRITON_FUSED_MOE
    return len(layers)
