"""Tiny GGUF files written from tiny HF checkpoints with the `gguf` package, as llama.cpp's converter
lays them out: its tensor names, Q/K rows permuted for the llama family, Gemma's norms stored as
1 + weight, float32 tensors and the architecture's metadata keys (no tokenizer: prompts are ids)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch
from safetensors.torch import load_file

# HF parameter name (layer part) -> llama.cpp name; Gemma's four norms differ from Llama's two.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for the llama family (each head's two rotary halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_folder: str, path: str) -> str:
    import gguf

    with open(os.path.join(hf_folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    # llama.cpp writes Mistral as "llama" (gguf-py has no "mistral" architecture).
    arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(config["model_type"], config["model_type"])
    gemma = arch.startswith("gemma")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or {}
    if arch == "gemma3":  # the file holds the global layers' rope; llama.cpp fixes the local layers' (10k)
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if arch in ("llama", "mistral"):
        writer.add_rope_dimension_count(head_dim)
    if gemma or arch == "qwen3":  # llama.cpp writes these where the config has its own head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if gemma:
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    tensors = {}
    for shard in sorted(f for f in os.listdir(hf_folder) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(hf_folder, shard)))
    for name, tensor in tensors.items():
        array = tensor.to(torch.float32).numpy()
        match = _LAYER.match(name)
        if match:
            layer, part, suffix = match.groups()
            gguf_name = f"blk.{layer}.{names[part]}.{suffix}"
        else:
            base, suffix = name.rsplit(".", 1)
            gguf_name = f"{_GLOBAL_NAMES[base]}.{suffix}"
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = _permute(array, heads if "q_proj" in name else kv_heads)
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp stores Gemma's (1 + w)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
