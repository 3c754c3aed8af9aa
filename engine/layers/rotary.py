"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(
    head_dim: int, rope_parameters: dict[str, Any], hf_config: Any, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] and the attention scaling factor for the configured rope type.

    Non-default rope types (llama3, linear, yarn, longrope) use transformers' own
    init functions so that our table is exactly the reference's. layer_type: the
    config's rope set for that kind of layer (Gemma 3's sliding and full attention).
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
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.to(torch.float32), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half convention, as HF Llama/Qwen) to q and k."""

    # float32 [max_positions, head_dim] tables: buffers, registered in __init__.
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_parameters: dict[str, Any],
        hf_config: Any,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        self._table_args = (head_dim, max_positions, rope_parameters, hf_config, layer_type)
        cos, sin = _cos_sin_tables(*self._table_args)
        # Kept in float32 and cast per call, as HF computes cos/sin in float32 then casts.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def rebuild(self) -> None:
        """Recompute the tables where the buffers now live (after a model left the meta device)."""
        cos, sin = _cos_sin_tables(*self._table_args)
        self.cos_cache = cos.to(self.cos_cache.device)
        self.sin_cache = sin.to(self.sin_cache.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _cos_sin_tables(
    head_dim: int, max_positions: int, rope_parameters: dict[str, Any], hf_config: Any, layer_type: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # Computed on the host even when the model is built on the meta device (transformers' rope init
    # functions copy to the CPU); the buffers move with the model.
    with torch.device("cpu"):
        inv_freq, scaling = rope_inverse_frequencies(head_dim, rope_parameters, hf_config, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
