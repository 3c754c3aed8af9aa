"""Qwen2-MoE (Qwen1.5-MoE): the decoder with sparse MoE MLPs (engine/models/moe.py) plus a shared
expert behind a sigmoid gate, top-k weights as routed (`norm_topk_prob`), dense layers where
`mlp_only_layers` says; a bias on q, k and v by `qkv_bias` (none on o). Its window applies only with
`use_sliding_window`.

On Gaudi its decode softmax runs in fp32, as Qwen2's (vllm-hpu-extension's release notes: "may
manually enable this flag for Qwen2 and Qwen2-MoE models to get better accuracy").
"""

from __future__ import annotations

from typing import Any

from engine.models.family import DecoderSettings, Family, FamilyTraits, SlidingWindow
from engine.models.moe import MoEConfig, MoEForCausalLM


def read_hf(hf_config: Any) -> DecoderSettings:
    return DecoderSettings(
        qkv_bias=bool(getattr(hf_config, "qkv_bias", False)), family_config=MoEConfig.from_qwen_hf(hf_config)
    )


FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    architectures=("Qwen2MoeForCausalLM",),
    model_class=MoEForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(fp32_softmax_on_hpu=True, sliding_window=SlidingWindow.OPT_IN),
)
