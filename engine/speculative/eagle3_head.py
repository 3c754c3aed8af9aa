"""An EAGLE-3 draft head as SGLang and vLLM load it (LlamaForCausalLMEagle3): one Llama decoder layer over
the target model's features.

At position p the head reads two things: the embedding of the token at p + 1 and a feature of width hidden.
After a target step the feature is `fc` of the target's residual streams at three layers
(engine/speculative/aux_hidden.py), concatenated (3 x hidden -> hidden); while the head drafts on its own it
is the head's previous output (before its final norm). The layer norms the two halves apart
(`input_layernorm` on the embedding, `hidden_norm` on the feature) and its attention projections take their
concatenation (2 x hidden inputs); the residual stream is the feature. Its own `norm` and `lm_head` score a
draft vocabulary of `draft_vocab_size` tokens, and `d2t` maps a draft id to the target's: target = draft +
d2t[draft]. `t2d` (target vocabulary, bool) marks the target ids that have a draft id.

The head keeps no cache itself: the caller passes an `attend` function that stores the layer's K/V and attends
over them (the proposer's batched attention over its store in the target pool's slot space,
engine/speculative/eagle3_kv.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.speculative.aux_hidden import default_aux_layers

ARCHITECTURE = "LlamaForCausalLMEagle3"
# (queries [tokens, heads, head_dim], keys and values [tokens, kv_heads, head_dim]) -> [tokens, heads, head_dim]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Eagle3Config:
    """The head's config.json, as the public checkpoints write it."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int  # the width of each of the target's three streams (fc takes three of them)
    max_position_embeddings: int
    # The target layers whose outputs feed fc (SGLang reads eagle_config's ids as "the output of layer i",
    # the stream entering layer i + 1); None: the default (the streams entering layers 2, L // 2, L - 3).
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool  # some heads take the normed feature as the residual stream (vLLM's key)
    hf: dict[str, Any]  # the whole config.json (rope settings)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Eagle3Config:
        """From config.json's keys; raises ValueError naming a missing or unusable one."""
        architectures = values.get("architectures") or []
        if architectures and not any("eagle3" in str(a).lower() for a in architectures):
            raise ValueError(f"architectures {architectures} is not an EAGLE-3 head ({ARCHITECTURE})")
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(values.get(key), int):
                raise ValueError(f"config.json needs an integer {key!r}")
        if int(values.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"num_hidden_layers {values['num_hidden_layers']}: an EAGLE-3 head has one layer")
        hidden, heads = int(values["hidden_size"]), int(values["num_attention_heads"])
        eagle = values.get("eagle_config") or {}
        layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(values["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(values.get("num_key_value_heads") or heads),
            head_dim=int(values.get("head_dim") or hidden // heads),
            rms_norm_eps=float(values.get("rms_norm_eps", 1e-6)),
            vocab_size=int(values["vocab_size"]),
            draft_vocab_size=int(values.get("draft_vocab_size") or values["vocab_size"]),
            target_hidden_size=int(values.get("target_hidden_size") or hidden),
            max_position_embeddings=int(values.get("max_position_embeddings", 2048)),
            aux_layer_ids=tuple(int(i) for i in layer_ids) if layer_ids else None,
            norm_before_residual=bool(values.get("norm_before_residual", False)),
            hf=dict(values),
        )

    def target_layers(self, num_target_layers: int) -> list[int]:
        """The target layers whose entering stream the tap records (AuxHiddenTap's indices)."""
        if self.aux_layer_ids is None:
            return default_aux_layers(num_target_layers)
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids needs three layers, got {list(self.aux_layer_ids)}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)}: layer {bad[0]} is not among the "
                f"target's {num_target_layers} layers"
            )
        return [i + 1 for i in self.aux_layer_ids]


def _rope_hf_config(values: dict[str, Any]) -> Any:
    """A transformers LlamaConfig of the head's keys: what non-default rope types read their settings from."""
    from transformers import LlamaConfig

    keys = {k: v for k, v in values.items() if k not in ("architectures", "eagle_config", "model_type")}
    return LlamaConfig(**keys)


class HeadRMSNorm(RMSNorm):
    """RMSNorm in two launches: F.rms_norm normalizes in float32 and rounds once to the input's dtype, as
    RMSNorm's seven ops do, then the weight. The draft loop runs 16 norms a step at one or a few rows each,
    where launches, not bytes, take the time (a fused kernel on CUDA)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.weight * F.rms_norm(hidden, (hidden.shape[-1],), eps=self.eps)
        return out


class Eagle3Attention(nn.Module):
    """q/k/v over the concatenated embedding and feature (2 x hidden inputs), o_proj back to hidden."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        inputs, heads, kv = 2 * config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = Linear(inputs, heads * config.head_dim, bias=False)
        self.k_proj = Linear(inputs, kv * config.head_dim, bias=False)
        self.v_proj = Linear(inputs, kv * config.head_dim, bias=False)
        self.o_proj = Linear(heads * config.head_dim, config.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Eagle3Layer(nn.Module):
    """The checkpoint's `midlayer`: its norms, attention and MLP."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = HeadRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = HeadRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = HeadRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config.hidden_size, config.intermediate_size)


class Eagle3Head(nn.Module):
    """The head's parameters under the checkpoint's names (midlayer.*, fc, norm, lm_head) and its steps."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, config: Eagle3Config, own_embedding: bool, max_positions: int = 0) -> None:
        """own_embedding: the checkpoint carries embed_tokens (most share the target's, and leave it out).
        max_positions: the rotary table's length at least (the target's context: public heads say 2,048 in
        their config and draft at every position the target reaches)."""
        super().__init__()
        from engine.model_config import _rope_parameters

        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embedding else None
        self.fc = Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = HeadRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        rope_config = _rope_hf_config(config.hf)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            max(config.max_position_embeddings, max_positions),
            _rope_parameters(rope_config),
            rope_config,
        )

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three streams [tokens, 3 x target hidden] as one feature [tokens, hidden]."""
        out: torch.Tensor = self.fc(aux_hidden)
        return out

    def layer(
        self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the LM head, output before the final norm: the next draft step's feature)."""
        layer = self.midlayer
        attention = layer.self_attn
        normed_feature = layer.hidden_norm(feature)
        residual = normed_feature if self.config.norm_before_residual else feature
        x = torch.cat([layer.input_layernorm(embeds), normed_feature], dim=-1)
        tokens, head_dim = x.shape[0], self.config.head_dim
        q = attention.q_proj(x).view(tokens, -1, head_dim)
        k = attention.k_proj(x).view(tokens, -1, head_dim)
        v = attention.v_proj(x).view(tokens, -1, head_dim)
        q, k = self.rotary(positions, q, k)
        hidden = residual + attention.o_proj(attend(q, k, v).reshape(tokens, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden), hidden

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary [rows, draft_vocab_size]."""
        out: torch.Tensor = self.lm_head(normed).float()
        return out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids as the target's (d2t holds the offsets)."""
        return draft_ids + self.d2t[draft_ids]

    def target_probs(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's distribution over the target's vocabulary [rows, vocab_size] (zero where t2d is off)."""
        probs = self.draft_logits(normed).softmax(-1)
        out = torch.zeros(probs.shape[0], self.config.vocab_size, dtype=probs.dtype, device=probs.device)
        ids = self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=probs.device))
        return out.index_copy_(1, ids, probs)
