"""The decoder with sparse MoE MLPs, which three families run (engine/models/families/mixtral.py,
qwen2_moe.py, qwen3_moe.py: each says how its config reads and what else its attention has);
Qwen2-MoE's adds a shared expert behind a sigmoid gate.

Their hyper-parameters are the family's own (`MoEConfig`, at
ModelConfig.family_config). Checkpoints store each expert's projections
apart (Mixtral: `block_sparse_moe.experts.E.w1|w3|w2`, Qwen3-MoE:
`mlp.experts.E.gate_proj|up_proj|down_proj`) and the router as
`block_sparse_moe.gate` / `mlp.gate`: the route below names the stacked
parameter and (expert, projection), and the stacked weights' own loader
(engine/layers/moe.py) puts the tensor in its slice. A checkpoint that
already stacks them (`mlp.experts.gate_up_proj`, as transformers 5 holds
them in memory) fills the whole parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoE, sparse_moe
from engine.models.decoder import DecoderForCausalLM
from engine.platform import CaptureSettings

# (layer, expert, projection) of a per-expert checkpoint tensor.
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_STACKED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
# projection -> (our stacked parameter, its part: gate or up of gate_up_proj; None: down_proj)
_PROJECTIONS = {
    "w1": ("gate_up_proj", "gate"),
    "gate_proj": ("gate_up_proj", "gate"),
    "w3": ("gate_up_proj", "up"),
    "up_proj": ("gate_up_proj", "up"),
    "w2": ("down_proj", None),
    "down_proj": ("down_proj", None),
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top-k weights renormalised to sum to one
    moe_layers: tuple[bool, ...]  # which layers are MoE (Qwen3-MoE: decoder_sparse_step / mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    @classmethod
    def from_qwen_hf(cls, hf_config: Any) -> MoEConfig:
        """Qwen2-MoE's and Qwen3-MoE's keys: every `decoder_sparse_step`-th layer is MoE unless listed
        in `mlp_only_layers`."""
        layers = hf_config.num_hidden_layers
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        experts = int(hf_config.num_experts)
        moe = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
        return cls(
            experts,
            hf_config.num_experts_per_tok,
            hf_config.moe_intermediate_size,
            bool(getattr(hf_config, "norm_topk_prob", False)),
            moe,
            int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
        )


class MoEForCausalLM(DecoderForCausalLM):
    def build_mlp(self, layer_index: int) -> nn.Module:
        moe: MoEConfig = self.config.family_config
        if not moe.moe_layers[layer_index]:
            return GatedMLP(self.config.hidden_size, self.config.intermediate_size, self.config.hidden_act)
        return sparse_moe(
            self.config.hidden_size,
            moe.moe_intermediate_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
            moe.shared_expert_intermediate_size,
        )

    def supports_device_graphs(self, capture: CaptureSettings) -> bool:
        # The torch experts op looks at which experts were hit (engine/layers/moe.py): CPU compiled
        # graphs call it between their pieces; a captured device graph needs a capturable method.
        return capture.host_syncs_ok or all(m.method.capturable for m in self.modules() if isinstance(m, SparseMoE))

    def checkpoint_route(self, name: str) -> tuple[str, Any] | None:
        if (router := _ROUTER.match(name)) is not None:
            return f"model.layers.{router.group(1)}.mlp.gate.weight", None  # Mixtral's router under our name
        if _STACKED.match(name) is not None:
            return name, None
        if (match := _EXPERT.match(name)) is not None:
            layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
            ours, part = _PROJECTIONS[projection]
            return f"model.layers.{layer}.mlp.experts.{ours}", (expert, part)
        return super().checkpoint_route(name)
