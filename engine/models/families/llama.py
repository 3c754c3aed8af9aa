"""Llama 2/3, SmolLM2 and Mistral: the neutral decoder as it is (pre-norm RMSNorm, SiLU-gated MLP,
rotary with any HF rope scaling). `attention_bias` puts a bias on q, k, v and o, as transformers'
Llama does (Mistral has none and no such key); Mistral's `sliding_window` covers every layer.

GGUF: llama.cpp writes both as "llama" (older converters: "mistral") and interleaves each head's two
rotary halves in the Q/K rows, undone at load (engine/loader/weights.py unpermute_rope_rows).
"""

from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM
from engine.models.family import Family, FamilyTraits, GGUFSpec, SlidingWindow, all_projection_bias
from engine.models.gguf_layout import DECODER_TENSOR_NAMES

FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral"),
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_class=DecoderForCausalLM,
    read_hf=all_projection_bias,
    traits=FamilyTraits(native_cpu_step=True, sliding_window=SlidingWindow.CONFIG),
    gguf=GGUFSpec(archs=("llama", "mistral"), tensor_names=DECODER_TENSOR_NAMES, rope_permuted=True),
)
