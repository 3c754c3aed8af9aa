"""RMSNorm computed as transformers does (in float32, weight applied in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # (dtype, rows): an output of at least `rows` rows is written in `dtype` (DecoderForCausalLM.
        # set_prefill_activations: the CPU's bf16 prefill GEMMs take it as it is, instead of casting it).
        self.many_rows_dtype: tuple[torch.dtype, int] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden32 = hidden.to(torch.float32)
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        hidden32 = hidden32 * torch.rsqrt(variance + self.eps)
        out = self.weight * hidden32.to(input_dtype)
        if self.many_rows_dtype is not None and hidden.shape[0] >= self.many_rows_dtype[1]:
            return out.to(self.many_rows_dtype[0])
        return out
