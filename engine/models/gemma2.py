"""Gemma 2: the Llama block with Gemma's twists, held against transformers' Gemma2ForCausalLM.

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
- GELU (tanh approximation) in the gated MLP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.layers.mlp import GatedMLP
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import lm_head, vocab_embedding
from engine.model_config import ModelConfig
from engine.models.llama import DecoderAttention, DecoderStack, KVCache, LlamaForCausalLM
from engine.models.registry import register_model


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


class Gemma2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        family: GemmaConfig = config.family_config
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_parameters, config.hf_config
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, self.rotary, family) for _ in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


@register_model("gemma2", architectures=("Gemma2ForCausalLM",))
class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class: Callable[[ModelConfig], DecoderStack] = Gemma2Model

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.attention_backend = None
        self.model = self.model_class(config)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = float(config.hidden_size) ** 0.5

    @classmethod
    def family_config(cls, hf_config: Any) -> GemmaConfig:
        return GemmaConfig.from_hf(hf_config)

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
