"""Tiny random EAGLE-3 heads in the public checkpoint layout (config.json + model.safetensors), for tests."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# SmolLM2-135M (the embedded model): hidden 576, 9 heads of 64, 3 KV heads, 30 layers, 49,152 tokens.
SMOL = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}


def build_eagle3_head(
    folder: str,
    draft_vocab_size: int = 2048,
    intermediate_size: int = 256,
    seed: int = 0,
    own_embedding: bool = False,
    layer_ids: list[int] | None = None,
    config_overrides: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    prefix: str = "midlayer.",
) -> str:
    """A random head for SmolLM2 as SGLang and vLLM read one: `midlayer.*` (or `prefix`), fc over three
    target streams, norm, lm_head over a draft vocabulary, d2t (draft id -> target id offset) and t2d.
    drop: tensor names left out (a broken checkpoint)."""
    os.makedirs(folder, exist_ok=True)
    hidden, heads, kv_heads, vocab = (
        SMOL["hidden_size"],
        SMOL["num_attention_heads"],
        SMOL["num_key_value_heads"],
        SMOL["vocab_size"],
    )
    head_dim = hidden // heads
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    config.update(config_overrides or {})
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator) * 2 - 1) * scale

    # The draft vocabulary: the target's ids with the smallest few first (the common ones, in a real head),
    # then random others; d2t holds target id - draft id, t2d marks the target ids it covers.
    chosen = torch.cat([torch.arange(256), 256 + torch.randperm(vocab - 256, generator=generator)])
    chosen = chosen[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        f"{prefix}hidden_norm.weight": 1 + rand(hidden),
        f"{prefix}input_layernorm.weight": 1 + rand(hidden),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden),
        f"{prefix}self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        f"{prefix}self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{prefix}self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": rand(intermediate_size, hidden),
        f"{prefix}mlp.up_proj.weight": rand(intermediate_size, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, intermediate_size),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab_size, hidden, scale=0.5),
        "d2t": chosen - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    for name in drop:
        tensors.pop(name)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return folder
