"""FP8 linears on CUDA: a weight-only Triton kernel at decode batch sizes, torch._scaled_mm above.

Decode reads every weight once per step, so at small batch an FP8 weight should cost half a bf16
one. torch._scaled_mm (cuBLASLt, W8A8) does not deliver that at M <= 128 on an H200: one layer's
four matmuls took 122 us at M = 1 against bf16's 125 us (the quantization issue's probe). The
Triton kernel (kernels/fp8_matmul.py) reads the e4m3 bytes, widens them in registers and runs a
bf16 dot, so activations stay bf16 (weight-only: more exact than W8A8) and the bytes are FP8's.
Larger batches are compute-bound, where _scaled_mm's FP8 tensor-core rate wins: activations are
quantized per token (dynamic scales) and the product is scaled by both. Block-scaled weights
(128 x 128) run the Triton kernel at every batch size, with wider row tiles above decode sizes.

All of it is one opaque op (engine::fp8_linear) so torch.compile sees a single call with a fake
for shapes, and CUDA graphs record its kernels; the choice of path depends only on the row count,
which a captured graph fixes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from backends.cuda.gemv import gemv
from backends.cuda.triton_build import load_kernel
from engine.layers.linear import SCALE_BLOCK, Linear
from engine.layers.live_rows import live_rows
from engine.layers.ops import define_op
from engine.quantization.fp8 import FP8_DTYPE, FP8_MAX

KERNELS = "backends.cuda.kernels.fp8_matmul"
# Rows up to which the weight-only kernel runs (per-channel scales); above, W8A8 _scaled_mm. H200,
# one Llama-3-8B layer's four matmuls (benchmarks/fp8_linear.py): the Triton kernel 93 us at 1-16
# rows against bf16's 115, but 169 at 32; W8A8 is bf16's speed at 32-64 rows and faster above.
WEIGHT_ONLY_MAX_ROWS = 16


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=8)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(rows: int, out_features: int, in_features: int, device: torch.device) -> KernelConfig:
    """Tiles for x [rows, in] @ w[out, in].T. Rows pad to a 16-row tile (tl.dot's least) at decode
    sizes; columns in narrow tiles so a small batch still gives every SM programs; split-K where the
    matrix is so narrow that even then the SMs would idle (o_proj and down_proj at batch 1)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 32 if rows <= 32 else 64
    block_k = 256 if rows <= 32 else 128
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 8
    programs = -(-out_features // block_n) * -(-rows // block_m)
    split_k = 1
    while programs * split_k < 2 * sms and split_k < 4 and in_features // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return KernelConfig(block_m, block_n, block_k, split_k)


def fp8_weight_only_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (weight [N, K] e4m3 * scale).T + bias -> [M, N] in x's dtype.
    scale: float32 [N] (per channel) or [ceil(N/128), ceil(K/128)] (blocks)."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    cfg = config or choose_config(rows, out_features, in_features, x.device)
    block_scale = scale.dim() == 2
    if block_scale and SCALE_BLOCK % cfg.block_k:
        cfg = KernelConfig(cfg.block_m, cfg.block_n, SCALE_BLOCK, cfg.split_k, cfg.num_warps, cfg.num_stages)
    if cfg.split_k > 1:
        out = torch.zeros(rows, out_features, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    kernel = load_kernel(KERNELS, "fp8_weight_matmul_kernel")
    grid = (-(-out_features // cfg.block_n), -(-rows // cfg.block_m), cfg.split_k)
    kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        scale.stride(0) if block_scale else 0,
        HAS_BIAS=bias is not None,
        SCALE_BLOCK=SCALE_BLOCK if block_scale else 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out if cfg.split_k == 1 else out.to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]) with each row's max at 448,
    in one Triton launch."""
    if x.device.type != "cuda":
        # Triton 3.6's interpreter narrows float32 to e4m3 wrongly (125.9 became 64), so off the GPU
        # (tests, and platforms reaching this through the CPU) the same quantization runs in torch.
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    rows, in_features = x.shape
    quantized = torch.empty(rows, in_features, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    load_kernel(KERNELS, "quantize_rows_kernel")[(rows,)](
        x, quantized, scale, in_features, x.stride(0), quantized.stride(0), FP8_MAX=FP8_MAX, BLOCK_K=1024, num_warps=4
    )
    return quantized, scale


def fp8_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8: x quantized per token, then cuBLASLt's FP8 GEMM with row-wise scales on both sides."""
    quantized, x_scale = quantize_rows(x)
    out = torch._scaled_mm(quantized, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out + bias


# One row with per-channel scales: the GEMV (backends/cuda/gemv.py), one launch without a 16-row tile.
GEMV_ONE_ROW = True


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if GEMV_ONE_ROW and live_rows(rows.shape[0]) == 1 and weight_scale.dim() == 1 and rows.is_cuda:
        # One row, or one live row and padding (engine/layers/live_rows.py: zeros for the padding).
        out = gemv(rows[:1], weight, bias, weight_scale, out_rows=rows.shape[0])
        return out.reshape(*x.shape[:-1], weight.shape[0])
    # torch._scaled_mm's row-wise scaling writes bf16 only; other activations stay weight-only.
    if weight_scale.dim() == 2 or rows.shape[0] <= WEIGHT_ONLY_MAX_ROWS or rows.dtype != torch.bfloat16:
        out = fp8_weight_only_matmul(rows, weight, weight_scale, bias)
    else:
        out = fp8_scaled_mm(rows, weight, weight_scale, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _fp8_linear_fake(x, weight, weight_scale, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


define_op(
    "fp8_linear",
    "(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias=None) -> Tensor",
    fp8_linear,
    _fp8_linear_fake,
)


class CudaFp8LinearMethod:
    """engine.layers.linear.LinearMethod for FP8 weights on CUDA (compute capability 8.9+)."""

    name = "fp8 (Triton weight-only up to 16 rows, torch._scaled_mm W8A8 above)"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.engine.fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)


CUDA_FP8 = CudaFp8LinearMethod()
