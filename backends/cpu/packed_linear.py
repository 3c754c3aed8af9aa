"""oneDNN-packed linear layers for the CPU decode path.

MKL's GEMV on this class of CPU streams weights at ~12 GB/s, oneDNN with
weights reordered ahead of time into its blocked layout at ~18-20 GB/s (and
uses AMX for bfloat16 batches), which nearly halves a SmolLM2 decode step.
This is what inductor's freezing pass does (mkldnn._linear_pointwise), but
freezing bakes weights into the graph as constants, which would stop the 30
decoder layers from sharing one compiled graph. So the packed copy hangs off
the weight tensor itself, and `engine::linear` (opaque to the compiler, as
attention is) uses it when present.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.ops import define_op

logger = logging.getLogger(__name__)

_PACKED_ATTR = "_engine_onednn_packed"


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = getattr(weight, _PACKED_ATTR, None)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear_fake(x, weight, bias):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


define_op("linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", packed_linear, _packed_linear_fake)


def onednn_packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


@torch.no_grad()
def pack_linear_weights(model: nn.Module, batch_hint: int) -> int:
    """Attach a oneDNN-packed copy to every nn.Linear weight; returns the bytes added."""
    added = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and not hasattr(module.weight, _PACKED_ATTR):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), batch_hint)
            setattr(module.weight, _PACKED_ATTR, packed)
            module.use_packed = True
            added += module.weight.nbytes
    logger.info("packed linear weights for oneDNN (batch hint %d, %.1f MiB)", batch_hint, added / 2**20)
    return added
