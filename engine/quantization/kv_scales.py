"""Per-layer FP8 KV cache scales from checkpoints (vLLM's `BaseKVCacheMethod`, SGLang's RadixAttention
`k_scale` / `v_scale`).

An FP8 KV cache stores k / k_scale and v / v_scale in e4m3, so that a layer whose keys or values
reach past e4m3's 448 keeps them instead of saturating. Checkpoints calibrated for it (llm-compressor,
ModelOpt, AutoFP8) carry one float32 scalar per layer and side, under the names vLLM reads:

- `model.layers.N.self_attn.k_scale` / `.v_scale` (AutoFP8, vLLM's serialized FP8), also with the
  attention module's own `.attn.` in between;
- `model.layers.N.self_attn.k_proj.k_scale` / `v_proj.v_scale` (ModelOpt);
- `model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale` (compressed-tensors);
- `model.layers.N.self_attn.kv_scale`: the legacy single scale, used for both sides.

The scales are taken out of the weight stream before the model's loaders see it (they are not
parameters) and set on every Attention module of decoder layer N once the weights are in. They apply
to an FP8 cache only: with a float cache they are ignored (one log line), as vLLM does, and a layer
the checkpoint has no scale for keeps 1.0 (vLLM's default, and this engine's FP8 cache before them).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.loader.param_loading import CheckpointTensor
    from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)

# Checkpoint name endings -> the sides ("k", "v") the scale is for; checked in this order.
_SUFFIX_SIDES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".kv_scale", ("k", "v")),
    (".k_proj.output_scale", ("k",)),
    (".v_proj.output_scale", ("v",)),
    (".k_scale", ("k",)),
    (".v_scale", ("v",)),
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# (decoder layer index, side) -> the scale
KVScales = dict[tuple[int, str], float]


def kv_scale_sides(name: str) -> tuple[str, ...]:
    """The sides ("k", "v") a checkpoint tensor scales, or () for any other tensor."""
    if ".self_attn." not in name:
        return ()
    for suffix, sides in _SUFFIX_SIDES:
        if name.endswith(suffix):
            return sides
    return ()


def _scale_value(name: str, tensor: CheckpointTensor) -> float:
    """The one positive, finite value of a per-tensor scale (read from the file if still lazy)."""
    if not isinstance(tensor, torch.Tensor):
        tensor = tensor.read()  # a tensor-parallel LazyTensor: a scale is whole on every rank
    if tensor.numel() != 1:
        raise ModelLoadError(
            f"{name}: KV cache scale of shape {tuple(tensor.shape)}; only per-tensor (one value) scales are supported"
        )
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ModelLoadError(f"{name}: KV cache scale {value} is not a positive finite number")
    return value


def split_kv_scales(
    weights: Iterable[tuple[str, CheckpointTensor]], found: KVScales
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors without its KV cache scales, which go into `found` as they pass."""
    for name, tensor in weights:
        sides = kv_scale_sides(name)
        if not sides:
            yield name, tensor
            continue
        layer = _LAYER.search(name)
        if layer is None:
            raise ModelLoadError(f"{name}: a KV cache scale outside any numbered decoder layer")
        value = _scale_value(name, tensor)
        for side in sides:
            found[(int(layer.group(1)), side)] = value


def apply_kv_scales(model: CausalLM, found: KVScales, kv_cache_dtype: torch.dtype | None, device: torch.device) -> int:
    """Every Attention module gets float32 k/v scales on `device`: the checkpoint's for an FP8 cache,
    1.0 otherwise (always set: a model materialised from the meta device holds no values yet).
    Returns how many layers took a checkpoint scale."""
    from engine.layers.attention import Attention

    used = found if kv_cache_dtype == torch.float8_e4m3fn else {}
    scaled = 0
    for index, layer in enumerate(model.decoder_layers()):
        k_scale, v_scale = used.get((index, "k"), 1.0), used.get((index, "v"), 1.0)
        if (index, "k") in used or (index, "v") in used:
            scaled += 1
        for module in layer.modules():
            if isinstance(module, Attention):
                module.set_kv_scales(k_scale, v_scale, device)
    _log_kv_scales(found, kv_cache_dtype, scaled)
    return scaled


def _log_kv_scales(found: KVScales, kv_cache_dtype: torch.dtype | None, scaled: int) -> None:
    """One line on what became of the checkpoint's scales, or of their absence under an FP8 cache."""
    fp8 = kv_cache_dtype == torch.float8_e4m3fn
    if found and not fp8:
        logger.info(
            "%d KV cache scales in the checkpoint ignored: they apply to an FP8 KV cache, this one is %s",
            len(found),
            kv_cache_dtype,
        )
    elif found:
        values = sorted(found.values())
        logger.info(
            "FP8 KV cache: checkpoint k/v scales for %d layers (%.4g to %.4g; any side without one: 1.0)",
            scaled,
            values[0],
            values[-1],
        )
    elif fp8:
        logger.info("FP8 KV cache at unit scale: the checkpoint has no k/v scales (values past +-448 saturate)")
