"""Gemma 3 (text, `gemma3_text`: Gemma-3-1B and the text tower of the larger ones): Gemma 2's block
(engine/models/gemma2.py) with per-head q/k norms, no soft-capping, and two rotary tables: sliding
layers rotate with their own base (`rope_parameters["sliding_attention"]`, 10k) and full-attention
layers with theirs (1M, with linear scaling on the 4B+ models), five sliding layers to one full one
(`layer_types`). Held against transformers' Gemma3ForCausalLM.
"""

from __future__ import annotations

from torch import nn

from engine.errors import UnsupportedArchitectureError
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import vocab_embedding
from engine.model_config import ModelConfig
from engine.models.gemma2 import Gemma2ForCausalLM, GemmaConfig, GemmaDecoderLayer, GemmaRMSNorm
from engine.models.registry import register_model


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


@register_model("gemma3_text", architectures=("Gemma3ForCausalLM",))
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model  # family_config, embed, compute_logits: Gemma 2's
