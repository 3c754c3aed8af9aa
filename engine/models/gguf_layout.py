"""llama.cpp's tensor names for the standard decoder (engine/models/decoder.py), which a family's
GGUFSpec starts from: llama.cpp base name -> HF name, {i} the layer index."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

DECODER_TENSOR_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "attn_norm": "model.layers.{i}.input_layernorm",
        "ffn_norm": "model.layers.{i}.post_attention_layernorm",
        "attn_q": "model.layers.{i}.self_attn.q_proj",
        "attn_k": "model.layers.{i}.self_attn.k_proj",
        "attn_v": "model.layers.{i}.self_attn.v_proj",
        "attn_output": "model.layers.{i}.self_attn.o_proj",
        "attn_q_norm": "model.layers.{i}.self_attn.q_norm",
        "attn_k_norm": "model.layers.{i}.self_attn.k_norm",
        "ffn_gate": "model.layers.{i}.mlp.gate_proj",
        "ffn_up": "model.layers.{i}.mlp.up_proj",
        "ffn_down": "model.layers.{i}.mlp.down_proj",
    }
)
