"""Qwen3: the neutral decoder with an RMSNorm per head on q and k before rotary (`q_norm`, `k_norm`
of head_dim each) and an explicit head_dim; `attention_bias` covers q, k, v and o. Its window applies
only with `use_sliding_window`.

GGUF: stored as in HF; the q/k norms are blk.N.attn_q_norm / attn_k_norm, and the head dimension is
`qwen3.attention.key_length` (engine/loader/resolve.py reads it for every family).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.models.decoder import DecoderForCausalLM
from engine.models.family import DecoderSettings, Family, FamilyTraits, GGUFSpec, SlidingWindow, all_projection_bias
from engine.models.gguf_layout import DECODER_TENSOR_NAMES


def read_hf(hf_config: Any) -> DecoderSettings:
    return replace(all_projection_bias(hf_config), qk_norm=True)


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    model_class=DecoderForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(native_cpu_step=True, sliding_window=SlidingWindow.OPT_IN),
    gguf=GGUFSpec(archs=("qwen3",), tensor_names=DECODER_TENSOR_NAMES),
)
