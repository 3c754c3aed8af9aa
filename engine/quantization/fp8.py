"""FP8 (e4m3) linear weights: quantizing, the reference method, and switching a model's linears.

A Linear in FP8 holds `weight` as float8_e4m3fn [out, in] and `weight_scale` as float32: one per
output row ([out]: per-channel, and per-tensor checkpoints expanded over each fused part's rows), or
one per 128 x 128 block ([out / 128, in / 128], the block-wise format of DeepSeek-V3 and Qwen3-FP8).
The dequantized weight is `weight * scale`.

Activations are never quantized with a checkpoint's static `input_scale`: the CUDA method keeps
them in bf16 at decode batch sizes (weight-only) and quantizes them per token, dynamically, for
larger batches, both at least as exact as one calibrated scale per tensor.

Which method runs is the platform's choice (its prepare_model): CUDA switches these layers to its
Triton / `torch._scaled_mm` method (backends/cuda/fp8_linear.py); platforms without an FP8 kernel
dequantize once to the model dtype (`dequantize_fp8_linears`), as GGUF does off the CPU. Until
then the layers carry FP8_REFERENCE, which is correct everywhere and is what the kernels are held to.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import DENSE, SCALE_BLOCK, Linear

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 [out, in], float32 scale [out]) with each row's max at 448."""
    absmax = weight.abs().amax(dim=1).float()
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    quantized = (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def expand_block_scale(scale: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """A [ceil(out/128), ceil(in/128)] block scale as one value per weight, [out, in]."""
    full = scale.repeat_interleave(SCALE_BLOCK, dim=0).repeat_interleave(SCALE_BLOCK, dim=1)
    return full[:out_features, :in_features]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight an FP8 weight and its scale (per row, or per block) stand for, in `dtype`."""
    if scale.dim() == 2:
        full = expand_block_scale(scale.float(), weight.shape[0], weight.shape[1])
        return (weight.float() * full).to(dtype)
    return (weight.float() * scale.float()[:, None]).to(dtype)


def fp8_reference_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ (weight * scale).T + bias in float32, rounded to x's dtype once: the numerics the kernels'
    weight-only path has (e4m3 values are exact in bf16; products summed in float32)."""
    if scale.dim() == 2:
        out = F.linear(x.float(), dequantize(weight, scale, torch.float32))
    else:
        out = F.linear(x.float(), weight.float()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class Fp8ReferenceMethod:
    """engine.layers.linear.LinearMethod over an FP8 weight, in plain torch (slow: it widens the
    whole weight every call); every platform's correct fallback and the kernels' reference."""

    name = "fp8_reference"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_reference_linear(x, layer.weight, layer.weight_scale, layer.bias)


FP8_REFERENCE = Fp8ReferenceMethod()


def is_fp8_linear(module: nn.Module) -> TypeGuard[Linear]:
    return isinstance(module, Linear) and module.weight.dtype == FP8_DTYPE


def fp8_linears(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, module in model.named_modules():
        if is_fp8_linear(module):
            yield name, module


def make_fp8_parameters(layer: Linear, block_scale: bool) -> None:
    """Give a Linear (on the meta device, before materialising) an FP8 weight and its scale, for a
    checkpoint that stores them; the loaders attach in Linear.attach_weight_loaders."""
    out_features, in_features = layer.out_features, layer.in_features
    device = layer.weight.device
    layer.weight = nn.Parameter(
        torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
    )
    if block_scale:
        shape: tuple[int, ...] = (-(-out_features // SCALE_BLOCK), -(-in_features // SCALE_BLOCK))
    else:
        shape = (out_features,)
    layer.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)
    layer.method = FP8_REFERENCE


@torch.no_grad()
def quantize_linears_online(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """`--quantization fp8` on a bf16/fp16 checkpoint: every dense Linear but the LM head becomes
    per-channel FP8 (the head stays in the model dtype, as vLLM and SGLang keep it: it is tied to the
    embedding in many models, and its errors land straight on the logits). Returns bytes saved."""
    saved = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.method is not DENSE or name in skip or name.endswith(skip):
            continue
        dense = module.weight
        quantized, scale = quantize_per_channel(dense.data)
        saved += dense.nbytes - quantized.nbytes - scale.nbytes
        module.weight = nn.Parameter(quantized, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        module.method = FP8_REFERENCE
        del dense
    return saved


@torch.no_grad()
def dequantize_fp8_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """The fallback of platforms without an FP8 kernel: every FP8 Linear dense in `dtype` again, once.
    Returns how many layers."""
    layers = 0
    for _, module in list(fp8_linears(model)):
        dense = dequantize(module.weight.data, module.weight_scale.data, dtype)
        module.weight = nn.Parameter(dense, requires_grad=False)
        del module.weight_scale
        module.method = DENSE
        layers += 1
    return layers
