"""What a checkpoint's `quantization_config` says, in the formats vLLM and SGLang read for FP8.

- `"quant_method": "fp8"` (transformers' FP8 / FineGrainedFP8 and vLLM's serialized FP8): e4m3
  weights with `weight_scale` (per tensor), or with `weight_block_size: [128, 128]` and
  `weight_scale_inv` (one scale per 128 x 128 block: DeepSeek-V3, Qwen3-FP8).
- `"quant_method": "compressed-tensors"` (llm-compressor, e.g. RedHatAI's FP8 models): config
  groups of 8-bit float weights, strategy tensor, channel or block, `weight_scale` tensors.

Which linears are FP8 is read from the checkpoint's tensor names (a layer is FP8 where its weight
has a scale beside it), so `ignore` lists need no interpretation. Static activation scales
(`input_scale`) are not used (docstring of engine/quantization/fp8.py), and the log says so; KV
cache scales are taken out of the weights before this module sees them (engine/quantization/kv_scales.py).
Every other method (AWQ, GPTQ, bitsandbytes, int4/int8 compressed-tensors, ...) is refused by name before
any weight is read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.loader.param_loading import CheckpointTensor
    from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)

SUPPORTED = "fp8 (per-tensor, per-channel or 128x128 blocks) and compressed-tensors FP8; GGUF files on the CPU"
# Checkpoint tensors the engine reads around, by design: static activation scales, and the attention
# scales of FP8 attention (q, softmax probabilities), which it does not run. KV cache scales never
# reach here: load_model takes them out first (engine/quantization/kv_scales.py).
UNUSED_SUFFIXES = (".input_scale", ".q_scale", ".prob_scale")


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "fp8"
    source: str  # the quant_method as the config names it
    block_scale: bool  # 128 x 128 block scales instead of one per tensor / channel
    scale_suffix: str  # the checkpoint's name for a weight's scale ("weight_scale" / "weight_scale_inv")
    fp8_modules: frozenset[str]  # checkpoint module names whose weights are FP8 ("model.layers.0.self_attn.q_proj")


def _as_dict(config: Any) -> dict[str, Any] | None:
    if config is None or isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    values: dict[str, Any] = to_dict() if to_dict else vars(config)
    return values


def _fp8_format(qc: dict[str, Any]) -> tuple[bool, str]:
    block = qc.get("weight_block_size")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"FP8 checkpoint in format {qc.get('fmt')!r}: only e4m3 weights are supported")
    if block is None:
        return False, "weight_scale"
    if list(block) != [128, 128]:
        raise ModelLoadError(
            f"block-wise FP8 with weight_block_size {list(block)}: only [128, 128] blocks are supported"
        )
    return True, "weight_scale_inv"


def _compressed_tensors_format(qc: dict[str, Any]) -> tuple[bool, str]:
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported (supported: {SUPPORTED})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(
            "compressed-tensors checkpoint without config_groups: nothing says how its weights are stored"
        )
    block = False
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ModelLoadError(
                f"compressed-tensors group {name!r} stores {weights.get('num_bits')}-bit {weights.get('type')} "
                f"weights: only 8-bit float (FP8) weights are supported (supported: {SUPPORTED})"
            )
        strategy = weights.get("strategy", "tensor")
        if strategy == "block":
            if list(weights.get("block_structure") or []) != [128, 128]:
                raise ModelLoadError(f"compressed-tensors group {name!r}: only [128, 128] weight blocks are supported")
            block = True
        elif strategy not in ("tensor", "channel"):
            raise ModelLoadError(
                f"compressed-tensors group {name!r}: weight strategy {strategy!r} is not supported "
                "(tensor, channel or block)"
            )
        activations = group.get("input_activations")
        if activations and (activations.get("num_bits") != 8 or activations.get("type") != "float"):
            raise ModelLoadError(
                f"compressed-tensors group {name!r} quantizes activations to "
                f"{activations.get('num_bits')}-bit {activations.get('type')}: only FP8 is supported"
            )
    return block, "weight_scale"


def checkpoint_quantization(hf_config: Any, tensor_names: Iterable[str]) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or None for a plain one; a ModelLoadError for what cannot run."""
    qc = _as_dict(getattr(hf_config, "quantization_config", None))
    if not qc:
        return None
    source = str(qc.get("quant_method", ""))
    if source == "fp8":
        block, suffix = _fp8_format(qc)
    elif source == "compressed-tensors":
        block, suffix = _compressed_tensors_format(qc)
    else:
        raise ModelLoadError(f"quantization method {source or 'unnamed'!r} is not supported (supported: {SUPPORTED})")
    tail = f".{suffix}"
    modules = frozenset(name[: -len(tail)] for name in tensor_names if name.endswith(tail))
    if not modules:
        raise ModelLoadError(f"{source} checkpoint has no *{tail} tensors: its FP8 weights cannot be scaled")
    return CheckpointQuantization("fp8", source, block, suffix, modules)


def rename_scales(
    weights: Iterable[tuple[str, CheckpointTensor]], quant: CheckpointQuantization
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Checkpoint tensors with scales under the engine's name (`weight_scale`), static activation and
    attention scales left out (counted in one log line)."""
    unused = 0
    tail = f".{quant.scale_suffix}"
    for name, tensor in weights:
        if name.endswith(UNUSED_SUFFIXES):
            unused += 1
            continue
        if name.endswith(tail):
            name = name[: -len(tail)] + ".weight_scale"
        yield name, tensor
    if unused:
        logger.info(
            "%d static activation / attention scales in the checkpoint not used: activations are quantized "
            "per token at run time",
            unused,
        )


def make_fp8_layers(model: CausalLM, quant: CheckpointQuantization) -> int:
    """Before materialising (meta device): every Linear whose checkpoint weights are FP8 gets FP8
    parameters. A fused Linear (q/k/v, gate/up) must have all of its parts in FP8 or none; FP8
    weights whose home is not a Linear (MoE experts) are refused. Returns how many layers."""
    from engine.layers.linear import Linear
    from engine.quantization.fp8 import make_fp8_parameters

    modules = dict(model.named_modules())
    parts: dict[str, set[Any]] = {}
    for name in sorted(quant.fp8_modules):
        route = model.checkpoint_route(f"{name}.weight")
        if route is None:
            continue
        param_name, part = route
        module_name = param_name.rsplit(".", 1)[0]
        if not isinstance(modules.get(module_name), Linear):
            raise ModelLoadError(
                f"checkpoint tensor {name}.weight is FP8, but its home {param_name!r} is not a linear "
                "layer (FP8 MoE experts are not supported yet)"
            )
        parts.setdefault(module_name, set()).add(part)
    for module_name, found in parts.items():
        layer = modules[module_name]
        assert isinstance(layer, Linear)  # each one checked above
        expected = set(layer.part_rows) or {None}
        if found != expected:
            raise ModelLoadError(
                f"{module_name} fuses parts {sorted(map(str, expected))} but the checkpoint has FP8 "
                f"weights for {sorted(map(str, found))} only: the parts must all be FP8 or none"
            )
        make_fp8_parameters(layer, quant.block_scale)
    return len(parts)
