"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(head_dim: int, rope_parameters: dict[str, Any], hf_config: Any) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] and the attention scaling factor for the configured rope type.

    Non-default rope types (llama3, linear, yarn, longrope) use transformers' own
    init functions so that our table is exactly the reference's.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = float(rope_parameters.get("rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling changes with sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half convention, as HF Llama/Qwen) to q and k."""

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict[str, Any], hf_config: Any) -> None:
        super().__init__()
        # The table is computed on the host even when the model is built on the meta device
        # (transformers' rope init functions copy to the CPU); it is moved with the model.
        with torch.device("cpu"):
            inv_freq, scaling = rope_inverse_frequencies(head_dim, rope_parameters, hf_config)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        # Kept in float32 and cast per call, as HF computes cos/sin in float32 then casts.
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
