"""Linear layers with a pluggable method, and fused projections that load from their parts.

`Linear.method` decides how the matmul runs: plain `F.linear` (every
platform's default), the CPU's oneDNN-packed weights
(backends/cpu/packed_linear.py), the CPU's GGUF blocks
(backends/cpu/gguf_linear.py) and FP8 weights (engine/quantization/fp8.py,
backends/cuda/fp8_linear.py), as vLLM's `LinearMethodBase`. A method is a stateless object set
per layer; compiled graphs see it as a constant, so switching a model's
method is done before capture.

A fused projection (q/k/v, gate/up) is one Linear whose rows are parts
(`parts` = their sizes in order); its weight (and bias) loads each part from
its own checkpoint tensor through the per-parameter weight loader.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.loader.param_loading import WHOLE, row_shard_loader, scale_loader, set_weight_loader

SCALE_BLOCK = 128  # block-wise FP8's block edge (DeepSeek-V3, Qwen3-FP8)


class LinearMethod(Protocol):
    """How a Linear's forward runs over its weight (and whatever the method attached to it)."""

    name: str

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...


class DenseLinearMethod:
    name = "dense"

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DENSE = DenseLinearMethod()


class Linear(nn.Linear):
    """nn.Linear whose matmul is `self.method`; `parts`: the row sizes of a fused projection."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parts: Sequence[tuple[Hashable, int]] | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = DENSE
        self.part_rows: dict[Hashable, tuple[int, int]] = {}
        start = 0
        for key, size in parts or ():
            self.part_rows[key] = (start, start + size)
            start += size
        if parts and start != out_features:
            raise ValueError(f"parts {list(parts)} add up to {start} rows, not {out_features}")
        self.attach_weight_loaders()

    def attach_weight_loaders(self) -> None:
        """(Again) after the parameters were replaced, as materialising a meta-device model does.
        An FP8 layer's `weight_scale` (engine/quantization/fp8.py) takes per-part scales."""
        for name, param in self.named_parameters(recurse=False):
            if name == "weight_scale":
                set_weight_loader(param, scale_loader(self.part_rows, self.out_features, SCALE_BLOCK),
                                  self.part_rows or WHOLE)
            elif self.part_rows:
                set_weight_loader(param, row_shard_loader(self.part_rows), self.part_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
