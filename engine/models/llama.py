"""The Llama family written once in eager PyTorch: Llama 2/3, SmolLM2, Mistral.

Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) reuse these layers with
the flags in ModelConfig. q/k/v and gate/up projections are fused into one
matmul each, as vLLM and SGLang do, so a decode step launches fewer kernels.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
# Our fused projections and how many checkpoint tensors each is made of (q, k, v; gate, up).
_FUSED_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


def fused_shards(param_name: str) -> int:
    """How many checkpoint tensors a parameter is fused from ("...qkv_proj.weight": 3); 0 if not fused."""
    parts = param_name.split(".")
    return _FUSED_SHARDS.get(parts[-2], 0) if len(parts) >= 2 else 0


class Linear(nn.Linear):
    """nn.Linear that a backend may switch to its own kernel (CPU: oneDNN-packed weights)."""

    use_packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_packed:
            return torch.ops.engine.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k.contiguous(), v.contiguous(), kv_cache, meta)
        return self.o_proj(out.reshape(tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block; `hidden` is the residual stream in and out.

    Holds no per-layer Python state (no layer index), so a compiled graph of
    one layer is reused by every layer of the same shape.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, moe: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if moe:
            from engine.layers.moe import SparseMoE

            self.mlp: nn.Module = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                            config.num_experts_per_tok, config.norm_topk_prob)
        else:
            self.mlp = GatedMLP(config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_parameters, config.hf_config
        )
        moe = config.moe_layers or [False] * config.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary, moe=moe[i]) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() -> hidden states of every token; compute_logits() on the rows that need them."""

    # HF checkpoint names fused into our projections: (our param, shard index).
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_backend: object | None = None
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, in float32 for sampling."""
        return self.lm_head(self.model.norm(hidden)).float()

    def set_sliding_window(self, window: int | None) -> None:
        """Every attention layer sees each query's last `window` positions (Mistral's sliding window)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.sliding_window = window

    def set_attention_backend(self, backend: object) -> None:
        """Every Attention layer runs through this platform's backend."""
        self.attention_backend = backend
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    def reset_non_persistent_buffers(self) -> None:
        """Rebuild tables that are computed, not loaded (after construction on the meta device)."""
        rotary = self.model.rotary
        fresh = RotaryEmbedding(
            self.config.head_dim, self.config.max_position_embeddings, self.config.rope_parameters, self.config.hf_config
        )
        rotary.cos_cache = fresh.cos_cache.to(rotary.cos_cache.device)
        rotary.sin_cache = fresh.sin_cache.to(rotary.sin_cache.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            special = self._load_special(name, tensor, params)
            if special is not None:
                filled.update(special)
                continue
            target, shard = self._target_of(name)
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no matching parameter ({target})")
            param = params[target]
            rows = self._shard_rows(target, shard, param.shape[0])
            dest = param.data if rows is None else param.data[rows[0] : rows[1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            if rows is not None:
                filled.add(f"{target}#{shard}")
            elif fused_shards(target):
                # A checkpoint that stores the fused projection itself (Phi-3): every shard at once.
                filled.update(f"{target}#{s}" for s in range(fused_shards(target)))
            else:
                filled.add(target)
        missing = [n for n in self._expected_fills(params) if n not in filled]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _load_special(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> list[str] | None:
        """A family's own checkpoint tensors (MoE experts): the fill keys it filled, or None (not one)."""
        return None

    def _target_of(self, name: str) -> tuple[str, int | None]:
        for hf_name, (ours, shard) in self.stacked_params.items():
            if f".{hf_name}." in name:
                return name.replace(hf_name, ours), shard
        return name, None

    def _shard_rows(self, target: str, shard: int | None, total_rows: int) -> tuple[int, int] | None:
        if shard is None:
            return None
        cfg = self.config
        if "qkv_proj" in target:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
        else:
            i = cfg.intermediate_size
            bounds = [(0, i), (i, 2 * i)]
        return bounds[shard]

    def _expected_fills(self, params: dict[str, nn.Parameter]) -> list[str]:
        expected = []
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            fused = fused_shards(name)
            if fused:
                expected += [f"{name}#{s}" for s in range(fused)]
            else:
                expected.append(name)
        return expected
