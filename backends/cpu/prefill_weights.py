"""A bf16 copy of the GGUF weights, packed for oneDNN, that many-row steps (prefill) multiply by.

The block kernels (gguf_linear.py) read a quarter of a bf16 matrix's bytes, which wins while a step has a
few rows and the weights stream from memory. A prefill step is compute-bound instead, and there the block
kernels pay for unpacking every block once per four rows and for two int8 levels per activation; oneDNN's
bf16 GEMM runs on the CPU's bf16 dot products (AVX512-BF16's vdpbf16ps, or AMX tiles) at its full rate.
So where the CPU multiplies bf16 natively, each GGUF linear also keeps its matrix dequantized once at load,
rounded to bf16 and reordered into oneDNN's blocked layout; steps of at least PREFILL_MIN_ROWS rows use it.

Numerics: the weights rounded to bf16 and each row's activations rounded to bf16 at the matmul's input,
float32 everywhere else (norms, attention, residuals, the KV cache). That is HF transformers' bf16 matmul
with everything around it in float32: on SmolLM2 its prefill logits are as close to HF float32's as HF
bf16's own are, or closer (tests/test_cpu_prefill_weights.py holds it to that). Decode rows keep the block
kernels' int8x2 numerics.

The cost is memory: two bytes per weight beside the blocks (SmolLM2-135M: ~200 MiB). `auto` keeps the copy
only on a CPU with native bf16 and only when it takes at most MAX_SHARE_OF_AVAILABLE of the memory available.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backends.cpu.features import cpu_features, onednn_bf16_supported
from backends.cpu.gguf_linear import PREFILL_MIN_ROWS, PREFILL_WEIGHT_ATTR, dequantize_tiles, gguf_tiles
from engine.config import CPU_PREFILL_WEIGHTS
from engine.errors import EngineError
from engine.layers.linear import Linear

logger = logging.getLogger(__name__)

MAX_SHARE_OF_AVAILABLE = 0.25  # auto: the copy may take at most this share of the memory available at load


def prefill_layers(model: nn.Module) -> list[Linear]:
    """The GGUF linears a prefill multiplies through: all but the LM head (which runs on the sampled rows)."""
    head = getattr(model, "lm_head", None)
    return [m for m in model.modules() if isinstance(m, Linear) and m is not head and gguf_tiles(m)]


def has_prefill_copy(model: nn.Module) -> bool:
    return any(has_copy(layer) for layer in prefill_layers(model))


def has_copy(layer: nn.Module) -> bool:
    """The linear multiplies many rows on a packed bf16 copy (so it takes bf16 inputs and gives bf16)."""
    tiles = gguf_tiles(layer) if isinstance(layer, Linear) else None
    return tiles is not None and len(tiles) > 0 and hasattr(tiles[0][2], PREFILL_WEIGHT_ATTR)


def copy_bytes(layers: list[Linear]) -> int:
    return sum(2 * layer.in_features * layer.out_features for layer in layers)


def choose_prefill_weights(mode: str, needed: int, available: int, activations: str = "auto") -> tuple[bool, str]:
    """(keep a bf16 copy?, why) for --cpu-prefill-weights `mode` on this CPU; `activations`: --gguf-activations."""
    if mode not in CPU_PREFILL_WEIGHTS:
        raise EngineError(f"--cpu-prefill-weights {mode!r}: choose one of {', '.join(CPU_PREFILL_WEIGHTS)}")
    if mode == "gguf":
        return False, "--cpu-prefill-weights gguf"
    if mode == "auto" and activations == "float32":
        return False, "--gguf-activations float32 asks for exact products"
    native = cpu_features().native_bf16 and onednn_bf16_supported()
    if mode == "bf16":
        if not onednn_bf16_supported():
            raise EngineError("--cpu-prefill-weights bf16: oneDNN cannot multiply bf16 on this CPU")
        return True, "--cpu-prefill-weights bf16"
    if not native:
        return False, f"no native bf16 dot products on this CPU ({cpu_features().describe()})"
    if needed > MAX_SHARE_OF_AVAILABLE * available:
        return False, (
            f"a bf16 copy ({needed / 2**20:.0f} MiB) would take more than {MAX_SHARE_OF_AVAILABLE:.0%} of the "
            f"memory available ({available / 2**20:.0f} MiB)"
        )
    return True, f"native bf16 on this CPU ({cpu_features().isa})"


@torch.no_grad()
def attach_prefill_weights(layers: list[Linear], batch_hint: int) -> int:
    """Give each layer its packed bf16 copy (on its first tiles tensor, where the gguf_linear op looks);
    returns the bytes added."""
    added = 0
    for layer in layers:
        parts = gguf_tiles(layer)
        dense = torch.cat([dequantize_tiles(tiles, fmt.code, rows, layer.in_features) for fmt, rows, tiles in parts])
        packed = torch.ops.mkldnn._reorder_linear_weight(dense.to(torch.bfloat16), batch_hint)
        setattr(parts[0][2], PREFILL_WEIGHT_ATTR, packed)
        added += 2 * dense.numel()
    return added


def describe(kept: bool, reason: str, added: int) -> str:
    if kept:
        return (
            f"prefill (steps of >= {PREFILL_MIN_ROWS} rows): oneDNN bf16 GEMM over a packed bf16 copy of the GGUF "
            f"weights ({added / 2**20:.0f} MiB; {reason})"
        )
    return f"prefill: GGUF block kernels ({reason})"
