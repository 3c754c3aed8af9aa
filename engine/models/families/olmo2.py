"""OLMo 2 (AllenAI): the decoder with its norms moved, held against transformers' Olmo2ForCausalLM.

- no norm before attention or the MLP: each sublayer's output is normed, then added to the residual
  (`post_attention_layernorm`, `post_feedforward_layernorm`);
- RMSNorm on q and k over the whole projection (every head at once: `q_norm` is num_heads * head_dim
  wide), before the heads are split and rotated;
- its RMSNorm multiplies the weight in float32 and casts once (Gemma's order, without the 1 +);
- `attention_bias` on q, k, v and o; SiLU-gated MLP; no sliding window; untied head.

Tensor parallelism is refused: a q/k norm spanning every head needs its statistics summed over the
ranks that hold the heads. GGUF is not read: llama.cpp writes "olmo2" files, but transformers'
GGUF reader has no OLMo-2 config mapping to build the model's config from.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.state import tp_state
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionMetadata
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderModel, DecoderStack, KVCache
from engine.models.family import Family, FamilyTraits, all_projection_bias


class Olmo2RMSNorm(nn.Module):
    """x / rms(x) * weight, all in float32, cast to the input dtype at the end."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(hidden.dtype)


class Olmo2Attention(DecoderAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        world = tp_state().world_size
        if world > 1:
            raise ModelLoadError(
                f"olmo2: its q/k norms span every head, which {world} tensor-parallel ranks would split "
                "(not implemented); use --tensor-parallel-size 1"
            )
        super().__init__(config, rotary, qk_norm=False)  # the decoder's per-head norms: not OLMo-2's
        self.q_norm = Olmo2RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(self.kv_size, config.rms_norm_eps)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.split_heads(self.q_norm(q), self.k_norm(k), v)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2ForCausalLM(DecoderForCausalLM):
    def build_model(self) -> DecoderStack:
        return DecoderModel(self.config, self.build_layer, norm_class=Olmo2RMSNorm)

    def build_layer(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return Olmo2DecoderLayer(self.config, rotary, self.build_mlp(layer_index))


FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    architectures=("Olmo2ForCausalLM",),
    model_class=Olmo2ForCausalLM,
    read_hf=all_projection_bias,
    traits=FamilyTraits(),  # full attention, bf16 softmax on Gaudi, the compiled graphs on the CPU
)
