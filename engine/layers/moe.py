"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, SiLU-gated experts.

Routing as the configs define it: a softmax over all experts in float32, the
top k, and (Mixtral always; Qwen3-MoE with `norm_topk_prob`) the k weights
renormalised to sum to one. Expert weights are stacked, [experts, 2 x
intermediate, hidden] for gate and up (fused, as the dense MLP's) and
[experts, hidden, intermediate] for down, so a grouped kernel can take them
as they are.

The experts run as one opaque op (`engine::moe_experts`): its torch
implementation visits only the experts some token picked (data-dependent
shapes, which a compiled graph must not see), so a compiled decode step keeps
static shapes around it (the CPU's graphs). It is not capturable in a device
graph (it looks at which experts were hit).

How the experts run is the layer's `method`, as a Linear's: TORCH_EXPERTS
(the op above) by default; the CUDA/ROCm platform switches every SparseMoE to
its fused Triton grouped GEMM (backends/cuda/moe_method.py), which is
capturable, so MoE models keep their CUDA graphs there. A model whose MoE
layers all have a capturable method may be captured
(MoEForCausalLM.supports_device_graphs).

With tensor parallelism every rank holds every expert, with its share of
each expert's intermediate dimension (vLLM's default for MoE under TP, rather
than whole experts per rank): routing is computed identically on every rank
from the same hidden states, every method runs unchanged on the narrower
weights (the CPU's torch op, the fused Triton kernel), and the ranks' partial
outputs, the shared expert's included, are summed by one all-reduce.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import all_reduce
from engine.distributed.sharding import even_shard
from engine.distributed.state import tp_state
from engine.errors import ModelLoadError
from engine.layers.mlp import GatedMLP
from engine.layers.ops import define_op
from engine.loader.param_loading import LazyTensor, copy_checked, fill_keys, set_weight_loader


def moe_experts(
    hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """hidden [T, H]; gate_up [E, 2I, H]; down [E, H, I]; expert_ids, weights [T, k] -> [T, H]."""
    out = torch.zeros_like(hidden)
    intermediate = down.shape[2]
    flat_ids = expert_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # the token slots, grouped by expert
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    tokens = order // expert_ids.shape[1]
    slot_weights = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = F.linear(hidden[rows], gate_up[expert]).split(intermediate, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, expert_out * slot_weights[start : start + count, None].to(expert_out.dtype))
        start += count
    return out


def _moe_experts_fake(
    hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(hidden)


define_op(
    "moe_experts",
    "(Tensor hidden, Tensor gate_up, Tensor down, Tensor expert_ids, Tensor weights) -> Tensor",
    moe_experts,
    _moe_experts_fake,
)


class ExpertWeights(nn.Module):
    """The stacked expert weights (`experts.gate_up_proj`, `experts.down_proj` in our names). Each loads
    one expert's projection at a time, shard (expert, "gate" | "up") or (expert, None), or all at once.
    With tensor parallelism: this rank's share of every expert's intermediate dimension."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        state = tp_state()
        self.shard = even_shard(intermediate_size, state.rank, state.world_size, "expert intermediate size")
        self.intermediate_size = self.shard.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.shard.size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard.size))
        self.attach_weight_loaders()

    def attach_weight_loaders(self) -> None:
        experts = range(self.gate_up_proj.shape[0])
        sharded = self.shard.count > 1
        loader = self._load_expert_shard if sharded else self._load_expert
        set_weight_loader(
            self.gate_up_proj, loader, [(e, half) for e in experts for half in ("gate", "up")], reads_lazily=sharded
        )
        set_weight_loader(self.down_proj, loader, [(e, None) for e in experts], reads_lazily=sharded)

    def _load_expert_shard(
        self, param: nn.Parameter, tensor: torch.Tensor | LazyTensor, shard: Any = None
    ) -> list[Hashable]:
        """This rank's intermediate rows (gate, up: [I, H]) or columns (down: [H, I]) of the checkpoint's
        per-expert tensor, or of the stacked tensor of all experts (shard None: [E, 2I, H] / [E, H, I])."""
        piece, size = self.shard, self.shard.size
        is_down = param is self.down_proj
        if shard is None:
            if is_down:
                copy_checked(
                    param.data, tensor.narrow(2, piece.start, size), "this rank's columns of stacked down_proj"
                )
            else:
                for half, rows, offset in (("gate", slice(0, size), 0), ("up", slice(size, 2 * size), piece.total)):
                    copy_checked(
                        param.data[:, rows],
                        tensor.narrow(1, offset + piece.start, size),
                        f"this rank's {half} rows of stacked gate_up_proj",
                    )
            return list(fill_keys(param))
        expert, half = shard
        if not 0 <= expert < param.shape[0]:
            raise ModelLoadError(f"expert {expert} of {param.shape[0]}")
        if half is None:
            copy_checked(param.data[expert], tensor.narrow(1, piece.start, size), f"expert {expert}'s columns")
        else:
            rows = slice(0, size) if half == "gate" else slice(size, 2 * size)
            copy_checked(param.data[expert][rows], tensor.narrow(0, piece.start, size), f"expert {expert} {half} rows")
        return [shard]

    def _load_expert(self, param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> list[Hashable]:
        if shard is None:
            copy_checked(param.data, tensor, f"stacked expert weights {tuple(param.shape)}")
            return list(fill_keys(param))
        expert, half = shard
        if not 0 <= expert < param.shape[0]:
            raise ModelLoadError(f"expert {expert} of {param.shape[0]}")
        dest = param.data[expert]
        if half is not None:
            size = self.intermediate_size
            dest = dest[(0 if half == "gate" else size) : (size if half == "gate" else 2 * size)]
        copy_checked(dest, tensor, f"expert {expert}" + ("" if half is None else f" {half}"))
        return [shard]


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing from router logits [T, E]: (expert ids [T, k], weights [T, k] float32), the softmax in
    float32 over all experts, its top k, renormalised to sum to one where the config asks."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return expert_ids, weights


class MoEMethod(Protocol):
    """How a token's experts are chosen (router logits [T, E] -> expert ids and float32 weights [T, k])
    and how the routed experts run (expert_ids, weights [T, k] -> [T, H])."""

    name: str
    capturable: bool  # no host sync and no data-dependent shape: may run inside a device graph

    def select_experts(
        self, logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def apply(
        self, layer: SparseMoE, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...


class TorchExpertsMethod:
    name = "torch"
    capturable = False

    def select_experts(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_top_k(logits, top_k, renormalize)

    def apply(
        self, layer: SparseMoE, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.engine.moe_experts(
            hidden, layer.experts.gate_up_proj, layer.experts.down_proj, expert_ids, weights
        )


TORCH_EXPERTS = TorchExpertsMethod()


class SparseMoE(nn.Module):
    """Routed experts, plus (Qwen2-MoE) a shared expert every token takes, scaled by a sigmoid gate."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.method: MoEMethod = TORCH_EXPERTS
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size)
        self.shared_expert: GatedMLP | None = None
        if shared_intermediate_size:
            # Under tensor parallelism its partial output is summed with the routed experts' (one all-reduce).
            self.shared_expert = GatedMLP(
                hidden_size, shared_intermediate_size, reduce_output=tp_state().world_size == 1
            )
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k] in the hidden dtype)."""
        logits = F.linear(hidden, self.gate.weight)
        expert_ids, weights = self.method.select_experts(logits, self.top_k, self.renormalize)
        return expert_ids, weights.to(hidden.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(hidden)
        out = self.method.apply(self, hidden, expert_ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


class TensorParallelSparseMoE(SparseMoE):
    """World size > 1: the same layer over this rank's share of every expert; the partial outputs (routed
    and shared: the shared expert's gate is a per-token scale, so it distributes over the sum) are summed
    over the ranks once."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(hidden))


def sparse_moe(
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    shared_intermediate_size: int = 0,
) -> SparseMoE:
    """A SparseMoE; its tensor-parallel form at world size > 1."""
    cls = SparseMoE if tp_state().world_size == 1 else TensorParallelSparseMoE
    return cls(hidden_size, intermediate_size, num_experts, top_k, renormalize, shared_intermediate_size)
