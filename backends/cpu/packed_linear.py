"""oneDNN-packed linear layers for the CPU decode path.

MKL's GEMV on this class of CPU streams weights at ~12 GB/s, oneDNN with
weights reordered ahead of time into its blocked layout at ~18-20 GB/s (and
uses AVX512-BF16, or AMX where the CPU has it, for bfloat16 batches), which nearly halves a SmolLM2 decode step.
This is what inductor's freezing pass does (mkldnn._linear_pointwise), but
freezing bakes weights into the graph as constants, which would stop the 30
decoder layers from sharing one compiled graph. So the packed copy hangs off
the weight tensor itself, and `engine::linear` (opaque to the compiler, as
attention is) uses it when present.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.cpu.features import native_gemv_bf16_supported, onednn_linear_supported
from backends.cpu.native import load
from engine.layers.linear import DENSE, Linear
from engine.layers.ops import define_op

logger = logging.getLogger(__name__)

_PACKED_ATTR = "_engine_onednn_packed"


# The native GEMV (kernels/gemv_bf16.c) wins for a few rows over weights that stream from memory;
# for bigger batches oneDNN's blocked GEMM kernels win, and for one very large matrix (the lm head)
# oneDNN's own streaming is faster.
GEMV_MAX_ROWS = 4
GEMV_MAX_WEIGHT_BYTES = 16 * 2**20


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = getattr(weight, _PACKED_ATTR, None)
    if packed is None:
        return F.linear(x, weight, bias)
    if (
        x.dtype == torch.bfloat16
        and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]
        and weight.nbytes <= GEMV_MAX_WEIGHT_BYTES
    ):
        out = native_gemv_bf16(x, weight, bias)
        if out is not None:
            return out
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def native_gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ weight.T (+ bias) through kernels/gemv_bf16.c; None where it does not apply here."""
    kernel = _gemv_kernel()
    if kernel is None or weight.dim() != 2 or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        return None
    n, k = weight.shape
    if k % 32 or n % 4 or x.shape[-1] != k or x.dtype != torch.bfloat16:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
        return None
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    status = kernel(
        rows.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        rows.shape[0],
        n,
        k,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


@cache
def _gemv_kernel() -> Any:
    if not native_gemv_bf16_supported():
        return None  # never load code built for instructions this CPU (or ENGINE_CPU_HIDE_FEATURES) lacks
    lib = load("gemv_bf16")
    if lib is None:
        return None
    fn = lib.gemv_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    # Probe once: -1 means this CPU (or compiler) has no AVX512-BF16.
    x, w = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16)
    y = torch.empty(1, 4, dtype=torch.bfloat16)
    if fn(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 1, 4, 32, 1) != 0:
        logger.info("native bf16 GEMV unavailable on this CPU (no AVX512-BF16): oneDNN for every batch")
        return None
    return fn


def _packed_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


define_op("linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", packed_linear, _packed_linear_fake)


PACKING_ENV = "ENGINE_CPU_ONEDNN_PACKING"  # "0" turns oneDNN packing off (plain F.linear)


def onednn_packing_supported(dtype: torch.dtype) -> bool:
    """Packing applies to this dtype on this CPU (and is not switched off by the environment)."""
    if os.environ.get(PACKING_ENV, "1") == "0":
        return False
    return onednn_linear_supported(dtype)


class OneDNNPackedLinearMethod:
    """engine.layers.linear.LinearMethod: the layer's weight with its oneDNN-packed copy attached."""

    name = "onednn_packed"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.engine.linear(x, layer.weight, layer.bias)


ONEDNN_PACKED = OneDNNPackedLinearMethod()


@torch.no_grad()
def pack_linear_weights(model: nn.Module, batch_hint: int, quiet: bool = False) -> int:
    """Attach a oneDNN-packed copy to every engine Linear weight the CPU can pack and switch the layer
    to ONEDNN_PACKED; returns the bytes added. (Other nn.Linear, such as an MoE router, stay plain.)

    The guard is here, not in the callers: a weight whose dtype this CPU cannot
    pack keeps the plain F.linear path, so no caller can reach a kernel the CPU lacks.
    """
    added = 0
    refused: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, Linear) and module.method is DENSE and not hasattr(module.weight, _PACKED_ATTR):
            if not onednn_packing_supported(module.weight.dtype):
                refused.add(module.weight.dtype)
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), batch_hint)
            setattr(module.weight, _PACKED_ATTR, packed)
            module.method = ONEDNN_PACKED
            added += module.weight.nbytes
    if refused and not quiet:
        logger.info(
            "oneDNN packing not used for %s on this CPU: plain F.linear", ", ".join(map(str, sorted(refused, key=str)))
        )
    if added and not quiet:
        logger.info("packed linear weights for oneDNN (batch hint %d, %.1f MiB)", batch_hint, added / 2**20)
    return added
