"""Gemma 3 (text, `gemma3_text`: Gemma-3-1B and the text tower of the larger ones): Gemma 2's block
(gemma2.py) with per-head q/k norms, no soft-capping, and two rotary tables: sliding
layers rotate with their own base (`rope_parameters["sliding_attention"]`, 10k) and full-attention
layers with theirs (1M, with linear scaling on the 4B+ models), five sliding layers to one full one
(`layer_types`). Held against transformers' Gemma3ForCausalLM.

GGUF: Gemma 2's names and (1 + w) norms. The file cannot say which layers are global nor the local
layers' rope base: llama.cpp fixes both in code (src/llama-model.cpp), and so does complete_gguf_config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from engine.errors import UnsupportedArchitectureError
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import vocab_embedding
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderStack
from engine.models.families.gemma2 import (
    GEMMA_TENSOR_NAMES,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaDecoderLayer,
    GemmaRMSNorm,
    complete_query_scale,
    read_hf,
)
from engine.models.family import Family, FamilyTraits, GGUFSpec, SlidingWindow

# llama.cpp's Gemma 3: a global layer after every five local ones, and the local layers' rope base.
GLOBAL_EVERY = 6
LOCAL_ROPE_BASE = 10000.0


def _rotary(config: ModelConfig, layer_type: str) -> RotaryEmbedding:
    hf = config.hf_config
    params = (getattr(hf, "rope_parameters", None) or {}).get(layer_type)
    if not params:
        raise UnsupportedArchitectureError(f"gemma3_text: no rope_parameters for {layer_type!r} layers")
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, params, hf, layer_type=layer_type)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        family: GemmaConfig = config.family_config
        types = list(config.hf_config.layer_types)
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        rotaries = {kind: _rotary(config, kind) for kind in sorted(set(types))}
        self.rotaries = nn.ModuleDict(rotaries)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, rotaries[kind], family, qk_norm=True) for kind in types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """embed and compute_logits: Gemma 2's (Gemma 3's final cap is None)."""

    def build_model(self) -> DecoderStack:
        return Gemma3Model(self.config)


def complete_gguf_config(config: Any, fields: Mapping[str, Any]) -> None:
    """The query scale (Gemma 2's rule, 62 layers for the 27B), llama.cpp's fixed layout, and the global
    layers' rope base and linear scaling, which transformers reads neither of (its config would keep a
    256 query scalar and unscaled global rope)."""
    complete_query_scale(config, big_model_layers=62)
    config.layer_types = [
        "full_attention" if (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(config.num_hidden_layers)
    ]
    full: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(fields.get("gemma3.rope.freq_base") or 1_000_000.0),
    }
    factor = float(fields.get("gemma3.rope.scaling.factor") or 1.0)
    if str(fields.get("gemma3.rope.scaling.type") or "") == "linear" and factor != 1.0:
        full.update(rope_type="linear", factor=factor)
    local = float(fields.get("gemma3.rope.freq_base_swa") or LOCAL_ROPE_BASE)
    config.rope_parameters = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    model_class=Gemma3ForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(sliding_window=SlidingWindow.CONFIG),
    gguf=GGUFSpec(
        archs=("gemma3",), tensor_names=GEMMA_TENSOR_NAMES, norm_offset=1.0, complete_config=complete_gguf_config
    ),
)
