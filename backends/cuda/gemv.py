"""One-row matmuls (decode at batch 1) through a Triton GEMV instead of cuBLAS.

At batch 1 every linear is a matrix-vector product bound by the weight bytes. On the H200 (torch
2.11, CUDA 13; benchmarks/profile_kernels.py) cuBLAS streamed gate_up (235 MB) at 4.2 TB/s but
q/k/v and o_proj (50 and 34 MB) at about 3.1 TB/s, and ran o_proj and down_proj split-K with a
reduce and a copy kernel after each. kernels/gemv.py does each in one launch; the sweep
(benchmarks/gemv_sweep.py, docs/results/h200_gemv_sweep_2026-12-02.json) found it faster on every
Llama-3-8B matrix in bf16 and in FP8, and in the engine it took the batch-1 replay from 4.73 to
4.31 ms (docs/cuda.md). `use_gemv` switches the dense bf16/fp16 linears; their op takes the GEMV for
one-row inputs and cuBLAS for more, decided inside the op at run time, so the compiled decode step's
batch-dynamic graph holds no branch on the rows. The batch-1 graph is captured over two rows with one
live (no size-1 compile: engine/layers/live_rows.py), and the op then computes the live row alone and
zeros the other: a two-row variant reading each weight tile once for both rows was no faster than
cuBLAS at two rows on the H200 (docs/results/h200_gemv_rows2_2026-12-02e.json).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backends.cuda.triton_build import compile_only, load_kernel
from engine.layers.linear import DENSE, Linear
from engine.layers.live_rows import live_rows
from engine.layers.ops import define_op

logger = logging.getLogger(__name__)

KERNELS = "backends.cuda.kernels.gemv"


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


def choose_config(out_features: int, in_features: int, weight_bytes: int) -> GemvConfig:
    """Tiles by shape, from the H200 sweep over Llama-3-8B's matrices (benchmarks/gemv_sweep.py,
    docs/results/h200_gemv_sweep_2026-12-02.json): wide matrices (gate_up, the LM head) in narrow
    row tiles, long rows (down_proj) in long column chunks, FP8 bytes in longer chunks than bf16's."""
    if weight_bytes == 1:
        if in_features >= 8192 or out_features * in_features <= 4096 * 4096:
            return GemvConfig(8, 1024, 4, 1)
        return GemvConfig(8, 512, 4, 1) if out_features >= 16384 else GemvConfig(16, 512, 8, 1)
    if out_features >= 16384:
        config = GemvConfig(4, 1024, 4, 1)
    else:
        config = GemvConfig(16, 1024, 8, 1) if in_features >= 8192 else GemvConfig(16, 512, 8, 1)
    if in_features % config.block_k and in_features % 512 == 0:
        # A row that 1024 does not divide (Gemma-2-9B's 3584) in 512-column chunks: no masked tail.
        config = GemvConfig(config.block_n, 512, config.num_warps, config.num_stages)
    return config


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    out_rows: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] (* scale [N] per row)).T + bias -> [1, N] in x's dtype, float32 sums.
    out_rows > 1: [out_rows, N], the rows after the first zeros (padding rows: engine/layers/live_rows.py).
    out: a contiguous [out_rows, N] tensor of x's dtype to write instead of a new one."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    out_features, in_features = weight.shape
    config = config or choose_config(out_features, in_features, weight.element_size())
    x = x.contiguous()
    if out is None:
        out = torch.empty(out_rows, out_features, dtype=x.dtype, device=x.device)
    elif out.shape != (out_rows, out_features) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"gemv writes a contiguous {x.dtype} [{out_rows}, {out_features}], got {out.dtype} {tuple(out.shape)}"
        )
    kernel = load_kernel(KERNELS, "gemv_kernel")
    grid = (-(-out_features // config.block_n),)
    kernel[grid](
        x,
        weight,
        scale if scale is not None else x,
        bias if bias is not None else x,
        out,
        out_features,
        in_features,
        weight.stride(0),
        out_rows - 1,
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        EVEN_N=out_features % config.block_n == 0,
        EVEN_K=in_features % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Chosen here, at run time, not in traced code (see GemvLinearMethod.apply). One live row (a batch-1
    # graph captured over a padding row too: engine/layers/live_rows.py) is a GEMV as well.
    rows = x.shape[0]
    if weight.is_cuda and live_rows(rows) == 1:
        return gemv(x[:1], weight, bias, out_rows=rows)
    return F.linear(x, weight, bias)


def _dense_gemv_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


define_op("dense_gemv", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _dense_gemv, _dense_gemv_fake)


class GemvLinearMethod:
    """engine.layers.linear.LinearMethod: one-row inputs through the Triton GEMV, others cuBLAS."""

    name = "dense_gemv"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # Every 2-D input goes through the op, which picks the GEMV or cuBLAS by its rows at run time: a
        # branch on the rows here would be traced into the compiled graphs as a guard. cuBLAS inside the op
        # was also a little faster than traced F.linear (batch-32 replay 5.466 against 5.532 ms, docs/cuda.md).
        return self.matmul(x, layer.weight, layer.bias)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return torch.ops.engine.dense_gemv(x, weight, bias)
        return F.linear(x, weight, bias)


GEMV = GemvLinearMethod()

# Weight matrices up to this many bytes take the GEMV (every matrix of Llama-3-8B, its 1 GB LM head
# included, was faster through it in the sweep); larger ones were not measured.
GEMV_MAX_WEIGHT_BYTES = 2 * 1024**3


def use_gemv(model: nn.Module) -> int:
    """Switch the dense bf16/fp16 linears the GEMV reads faster; returns how many were switched (the
    platform decides whether to call it: CudaPlatform.one_row_gemv)."""
    switched = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.method is not DENSE:
            continue
        weight = module.weight
        if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
            continue
        if weight.numel() * weight.element_size() > GEMV_MAX_WEIGHT_BYTES:
            continue
        module.method = GEMV
        switched += 1
    return switched


def precompile_gemv(model: nn.Module) -> int:
    """Compile ahead (compile_only launches) the GEMV variant of every linear switched to it: one per
    distinct (shape, dtype, bias), whose tiles choose_config picks (the same variant zeros padding rows).
    Returns the launches made."""
    seen: set[tuple] = set()
    with compile_only():
        for module in model.modules():
            operands = _gemv_operands(module) if isinstance(module, Linear) else None
            if operands is None:
                continue
            weight, bias = operands
            key = (tuple(weight.shape), weight.dtype, bias is not None)
            if key in seen:
                continue
            seen.add(key)
            gemv(torch.empty(1, weight.shape[1], dtype=weight.dtype, device=weight.device), weight, bias)
    return len(seen)


def _gemv_operands(module: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What the layer's one-row matmul reads: its weight (and bias) under the GEMV, or the weight with LoRA's A
    folded in under a LoRA method over the GEMV (engine/lora/layers.py); None: no GEMV."""
    method = module.method
    if method is GEMV:
        return module.weight, module.bias
    if getattr(method, "base", None) is GEMV and getattr(method, "folded", False):
        return module.lora_folded_weight, module.lora_folded_bias  # type: ignore[return-value]
    return None
