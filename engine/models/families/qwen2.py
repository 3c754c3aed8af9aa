"""Qwen2 (and Qwen2.5): the neutral decoder with a bias on q, k and v, always (transformers' Qwen2
has no key for it; o_proj has none). Its window applies only with `use_sliding_window`, to the layers
`layer_types` marks (transformers derives them from `max_window_layers`).

On Gaudi its decode softmax runs in fp32: vllm-hpu-extension's features.py enables fp32_softmax for
ModelType('qwen2') (later releases add qwen2_5_vl); everything else runs it in bf16.
"""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderForCausalLM
from engine.models.family import DecoderSettings, Family, FamilyTraits, GGUFSpec, SlidingWindow
from engine.models.gguf_layout import DECODER_TENSOR_NAMES


def read_hf(hf_config: Any) -> DecoderSettings:
    return DecoderSettings(qkv_bias=True)


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    model_class=DecoderForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(fp32_softmax_on_hpu=True, native_cpu_step=True, sliding_window=SlidingWindow.OPT_IN),
    # Stored as in HF (no Q/K row permutation); the biases come as blk.N.attn_q.bias etc.
    gguf=GGUFSpec(archs=("qwen2",), tensor_names=DECODER_TENSOR_NAMES),
)
