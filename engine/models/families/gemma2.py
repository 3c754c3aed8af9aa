"""Gemma 2: the decoder with Gemma's twists, held against transformers' Gemma2ForCausalLM.

- RMSNorm scales by (1 + weight), computed in float32 and cast once (Gemma's, not Llama's order);
- four norms a layer: after attention and around the MLP (`post_attention_layernorm`,
  `pre_feedforward_layernorm`, `post_feedforward_layernorm`), each before its residual add;
- embeddings times sqrt(hidden_size), rounded to the model dtype first as transformers does;
- attention scaled by query_pre_attn_scalar ** -0.5 and its scores soft-capped
  (`attn_logit_softcapping`: cap * tanh(score / cap)), which SDPA and FlashAttention-style fused
  kernels without a cap cannot do: the torch path computes it explicitly, the Triton kernels take
  it as a constexpr switch;
- sliding-window attention on alternate layers (`layer_types`), each layer its own window;
- the LM head tied to the embedding, its logits soft-capped (`final_logit_softcapping`);
- GELU (tanh approximation) in the gated MLP; `attention_bias` on q, k, v and o.

GGUF: llama.cpp's names for the four norms (its ffn_norm is the norm before the MLP, which Gemma
calls pre_feedforward_layernorm), norms stored as 1 + weight, and the query scale and caps completed
from the metadata (below). Gemma 3 (gemma3.py) builds on this block.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.layers.mlp import GatedMLP
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderModel, DecoderStack, KVCache
from engine.models.family import DecoderSettings, Family, FamilyTraits, GGUFSpec, SlidingWindow, all_projection_bias
from engine.models.gguf_layout import DECODER_TENSOR_NAMES


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast to the input dtype at the end."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(hidden.dtype)


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 2's and Gemma 3's own hyper-parameters (ModelConfig.family_config)."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    hidden_activation: str

    @classmethod
    def from_hf(cls, hf_config: Any) -> GemmaConfig:
        return cls(
            float(hf_config.query_pre_attn_scalar),
            hf_config.attn_logit_softcapping,
            hf_config.final_logit_softcapping,
            hf_config.hidden_activation or "gelu_pytorch_tanh",
        )


def read_hf(hf_config: Any) -> DecoderSettings:
    """Gemma 2 and 3: biases by `attention_bias`, their own hyper-parameters (Gemma 3's q/k norms are
    its layer's, not the decoder's per-head switch)."""
    bias = all_projection_bias(hf_config)
    return DecoderSettings(bias.qkv_bias, bias.o_proj_bias, family_config=GemmaConfig.from_hf(hf_config))


class GemmaDecoderLayer(nn.Module):
    """qk_norm: Gemma 3's per-head q/k norms (Gemma's (1 + w) kind)."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, family: GemmaConfig, qk_norm: bool = False
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = DecoderAttention(
            config,
            rotary,
            scale=family.query_pre_attn_scalar**-0.5,
            softcap=family.attn_logit_softcapping,
            norm_class=GemmaRMSNorm,
            qk_norm=qk_norm,
        )
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, family.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


class Gemma2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def build_model(self) -> DecoderStack:
        return DecoderModel(self.config, self.build_layer, norm_class=GemmaRMSNorm)

    def build_layer(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return GemmaDecoderLayer(self.config, rotary, self.config.family_config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # transformers rounds the normalizer to the model dtype before multiplying (bf16: 45.25 for 2048);
        # as a Python float of that value the product is the same, and no tensor is made on the host
        # (this runs inside CUDA graph capture).
        return hidden * _rounded(self.embed_scale, hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)
        cap = self.config.family_config.final_logit_softcapping
        if not cap:
            return logits
        return torch.tanh(logits / cap) * cap if out is None else logits.div_(cap).tanh_().mul_(cap)


# llama.cpp's ffn_norm is the norm before the MLP, which Llama calls post_attention_layernorm but Gemma
# calls pre_feedforward_layernorm (its post_attention_layernorm follows attention).
GEMMA_TENSOR_NAMES: Mapping[str, str] = {
    **DECODER_TENSOR_NAMES,
    "post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}


def complete_query_scale(config: Any, big_model_layers: int) -> None:
    """The query scale transformers' GGUF reader leaves at its class default: llama.cpp scales by
    key_length ** -0.5 except on the 27B (Gemma 2: 46 layers, Gemma 3: 62), where it takes hidden /
    heads, the HF configs' query_pre_attn_scalar."""
    per_head = config.hidden_size // config.num_attention_heads
    config.query_pre_attn_scalar = per_head if config.num_hidden_layers == big_model_layers else config.head_dim


def complete_gguf_config(config: Any, fields: Mapping[str, Any]) -> None:
    complete_query_scale(config, big_model_layers=46)


FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    architectures=("Gemma2ForCausalLM",),
    model_class=Gemma2ForCausalLM,
    read_hf=read_hf,
    traits=FamilyTraits(sliding_window=SlidingWindow.CONFIG, softcap=True),
    gguf=GGUFSpec(
        archs=("gemma2",), tensor_names=GEMMA_TENSOR_NAMES, norm_offset=1.0, complete_config=complete_gguf_config
    ),
)
