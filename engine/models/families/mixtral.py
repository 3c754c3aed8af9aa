"""Mixtral: the decoder with a sparse MoE MLP in every layer (engine/models/moe.py): `num_local_experts`
experts, top `num_experts_per_tok`, the top-k weights renormalised; no bias; `sliding_window` on every
layer when set. Checkpoints name the experts block_sparse_moe.experts.E.w1|w3|w2.

GGUF: llama.cpp writes Mixtral as "llama" with stacked ffn_*_exps tensors, which no loader here maps.
"""

from __future__ import annotations

from typing import Any

from engine.models.family import DecoderSettings, Family, FamilyTraits, SlidingWindow
from engine.models.moe import MoEConfig, MoEForCausalLM


def read_hf(hf_config: Any) -> DecoderSettings:
    layers = hf_config.num_hidden_layers
    moe = MoEConfig(
        hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size, True, (True,) * layers
    )
    return DecoderSettings(family_config=moe)


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM",),
    model_class=MoEForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(sliding_window=SlidingWindow.CONFIG),
)
