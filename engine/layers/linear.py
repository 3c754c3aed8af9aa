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

Tensor parallelism (engine/distributed/): `column_parallel_linear` and
`row_parallel_linear` build a model's projections. At world size 1 they are
the plain Linear above, nothing else; at world size > 1 a column-parallel
layer holds its rank's rows of each part (its loader narrows each checkpoint
part to them) and a row-parallel one its rank's input columns, summing the
ranks' partial products with one all-reduce.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import all_reduce
from engine.distributed.sharding import Shard
from engine.distributed.state import tp_state
from engine.loader.param_loading import (
    WHOLE,
    column_parallel_loader,
    first_rank_bias_loader,
    row_parallel_loader,
    row_shard_loader,
    scale_loader,
    set_weight_loader,
)

SCALE_BLOCK = 128  # block-wise FP8's block edge (DeepSeek-V3, Qwen3-FP8)


class LinearMethod(Protocol):
    """How a Linear's forward runs over its weight (and whatever the method attached to it)."""

    name: str

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class WeightMatmul(Protocol):
    """A LinearMethod whose product reads nothing but the weight and bias tensors it is given, so that it serves
    any weight of the layer's layout, such as one with rows appended (engine/lora/layers.py folds LoRA's A into
    the base weight through it); methods with packed or quantized copies of the weight have no `matmul`."""

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class DenseLinearMethod:
    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.bias)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


DENSE = DenseLinearMethod()


class Linear(nn.Linear):
    """nn.Linear whose matmul is `self.method`; `parts`: the row sizes of a fused projection."""

    # An FP8 layer's scale parameter (engine/quantization/fp8.py sets it; others have none).
    weight_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parts: Sequence[tuple[Hashable, int]] | None = None,
    ) -> None:
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
                set_weight_loader(
                    param, scale_loader(self.part_rows, self.out_features, SCALE_BLOCK), self.part_rows or WHOLE
                )
            elif self.part_rows:
                set_weight_loader(param, row_shard_loader(self.part_rows), self.part_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks (world size > 1): each part (q, k, v; gate, up; or the one part
    "" of a plain layer) holds this rank's piece of the checkpoint's part. Outputs stay per rank."""

    def __init__(self, in_features: int, parts: Sequence[tuple[Hashable, Shard]], bias: bool = False) -> None:
        self.shards = dict(parts)  # plain attributes may be set before nn.Module.__init__; loaders need them
        fused = list(self.shards) != [""]
        super().__init__(
            in_features,
            sum(piece.size for piece in self.shards.values()),
            bias=bias,
            parts=[(key, piece.size) for key, piece in parts] if fused else None,
        )

    def attach_weight_loaders(self) -> None:
        rows = self.part_rows or {"": (0, self.out_features)}
        for _, param in self.named_parameters(recurse=False):
            set_weight_loader(
                param, column_parallel_loader(rows, self.shards), self.part_rows or WHOLE, reads_lazily=True
            )


class RowParallelLinear(Linear):
    """Input columns split over the ranks (world size > 1): each rank multiplies its slice of the input
    (the column-parallel layer's output before it) and the partial products are summed over the ranks
    (reduce_results=False: the caller sums, once for several partial products, as the MoE layer does)."""

    def __init__(self, input_shard: Shard, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        self.input_shard = input_shard
        self.reduce_results = reduce_results
        super().__init__(input_shard.size, out_features, bias=bias)

    def attach_weight_loaders(self) -> None:
        set_weight_loader(self.weight, row_parallel_loader(self.input_shard), reads_lazily=True)
        if self.bias is not None:
            set_weight_loader(self.bias, first_rank_bias_loader(tp_state().rank), reads_lazily=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return all_reduce(out) if self.reduce_results else out


def column_parallel_linear(in_features: int, parts: Sequence[tuple[Hashable, Shard]], bias: bool = False) -> Linear:
    """q/k/v, gate/up or a plain layer (one part ""): parts -> this rank's piece of each. At world size 1 the
    plain (fused) Linear."""
    if tp_state().world_size == 1:
        fused = [(key, piece.size) for key, piece in parts]
        return Linear(
            in_features,
            sum(size for _, size in fused),
            bias=bias,
            parts=fused if [k for k, _ in fused] != [""] else None,
        )
    return ColumnParallelLinear(in_features, parts, bias=bias)


def row_parallel_linear(
    input_shard: Shard, out_features: int, bias: bool = False, reduce_results: bool = True
) -> Linear:
    """o_proj, down_proj: this rank's input columns. At world size 1 the plain Linear."""
    if tp_state().world_size == 1:
        return Linear(input_shard.total, out_features, bias=bias)
    return RowParallelLinear(input_shard, out_features, bias=bias, reduce_results=reduce_results)
