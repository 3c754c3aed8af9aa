"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm; `attention_bias` on q, k, v and o) with sparse
MoE MLPs (engine/models/moe.py), dense layers where `mlp_only_layers` says. Its window applies only
with `use_sliding_window`.

GGUF: llama.cpp's qwen3moe files stack the experts as ffn_*_exps, which no loader here maps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.models.family import DecoderSettings, Family, FamilyTraits, SlidingWindow, all_projection_bias
from engine.models.moe import MoEConfig, MoEForCausalLM


def read_hf(hf_config: Any) -> DecoderSettings:
    return replace(all_projection_bias(hf_config), qk_norm=True, family_config=MoEConfig.from_qwen_hf(hf_config))


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    model_class=MoEForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(sliding_window=SlidingWindow.OPT_IN),
)
