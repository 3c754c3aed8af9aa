"""RMSNorm computed as transformers does (in float32, weight applied in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden32 = hidden.to(torch.float32)
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        hidden32 = hidden32 * torch.rsqrt(variance + self.eps)
        return self.weight * hidden32.to(input_dtype)
