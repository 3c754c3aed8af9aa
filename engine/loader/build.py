"""Build a model on its device and fill it from a ModelSource (or with random weights)."""

from __future__ import annotations

import logging
import time
import zlib

import torch

from engine.distributed.state import tp_state
from engine.errors import ModelLoadError
from engine.loader.param_loading import attach_weight_loaders
from engine.loader.resolve import ModelSource
from engine.loader.weights import gguf_weights, safetensors_names, safetensors_weights
from engine.model_config import ModelConfig
from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    quantization: str = "auto",
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """quantization: "auto" (the checkpoint's own: FP8 layers stay FP8), "fp8" (also quantize a dense
    checkpoint's linears at load), "none" (FP8 checkpoints dequantized to `dtype`), "gguf" (the CPU
    platform keeps GGUF blocks later; nothing here). kv_cache_dtype: the KV cache's; an FP8 one takes
    the checkpoint's per-layer k/v scales (engine/quantization/kv_scales.py), any other ignores them."""
    # Imported here: engine.quantization needs engine.layers, which imports this package's loaders.
    from engine.quantization.checkpoint import checkpoint_quantization, make_fp8_layers, rename_scales
    from engine.quantization.fp8 import dequantize_fp8_linears, quantize_linears_online
    from engine.quantization.kv_scales import apply_kv_scales, split_kv_scales

    config = ModelConfig.from_hf(source.hf_config)
    start = time.perf_counter()
    quant = None
    if source.kind == "hf" and load_format != "dummy":
        quant = checkpoint_quantization(source.hf_config, safetensors_names(source.path))
    if quantization == "fp8" and source.kind == "gguf":
        raise ModelLoadError(
            f"{source.path}: --quantization fp8 takes a safetensors checkpoint or a preset, not a GGUF file"
        )
    world = tp_state().world_size
    if world > 1:
        _check_shardable(source, quant, quantization)
    # Built on the meta device, then materialised once on the target: no wasted random init.
    with torch.device("meta"):
        model = config.model_class(config)
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"{type(model).__name__} is not a torch.nn.Module, as every model family must be")
    model = model.to(dtype=dtype)
    if quant is not None:
        layers = make_fp8_layers(model, quant)
        logger.info(
            "checkpoint quantization %s: %d linear layers in FP8 (e4m3, %s scales)",
            quant.source,
            layers,
            "128x128 block" if quant.block_scale else "per-tensor/channel",
        )
    model = model.to_empty(device=device)
    attach_weight_loaders(model)  # materialising made new parameter objects
    model.after_materialize()
    kv_scales: dict[tuple[int, str], float] = {}  # filled by split_kv_scales as the weights stream past
    if load_format == "dummy" or source.kind == "preset":
        if source.kind == "preset" and load_format != "dummy":
            raise ModelLoadError(f"{source.path}: a preset has no weights; pass --load-format dummy")
        fill_dummy_weights(model, per_parameter_seeds=world > 1)
    elif source.kind == "gguf":
        with torch.no_grad():
            model.load_weights(gguf_weights(source.path, source.hf_config))
    else:
        # Tensor parallelism: each rank's loaders read only their shard of each tensor from the file.
        weights = split_kv_scales(safetensors_weights(source.path, lazy=world > 1), kv_scales)
        with torch.no_grad():
            model.load_weights(rename_scales(weights, quant) if quant is not None else weights)
    model.eval().requires_grad_(False)
    apply_kv_scales(model, kv_scales, kv_cache_dtype, device)
    if quant is not None and quantization == "none":
        logger.info(
            "--quantization none: %d FP8 layers dequantized to %s at load", dequantize_fp8_linears(model, dtype), dtype
        )
    elif quantization == "fp8" and quant is None:
        saved = quantize_linears_online(model)
        logger.info(
            "--quantization fp8: linear weights quantized to FP8 e4m3 per output channel at load "
            "(the LM head stays %s), %.0f MiB saved",
            dtype,
            saved / 2**20,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the KV pool is sized from free memory next
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM params, %s) on %s in %.2f s",
        config.model_type,
        source.kind if load_format != "dummy" else "dummy",
        params / 1e6,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model, config


def _check_shardable(source: ModelSource, quant: object, quantization: str) -> None:
    """Tensor parallelism shards dense safetensors weights (and dummy ones); the rest is refused here, by name."""
    world = tp_state().world_size
    if source.kind == "gguf":
        raise ModelLoadError(
            f"{source.path}: a GGUF model cannot be split over {world} tensor-parallel ranks (its "
            "blocks are not sharded); use a safetensors checkpoint or --tensor-parallel-size 1"
        )
    if quant is not None or quantization == "fp8":
        raise ModelLoadError(
            f"FP8 weights cannot be split over {world} tensor-parallel ranks yet (their scales are not "
            "sharded); use a bf16/fp16 checkpoint without --quantization fp8, or --tensor-parallel-size 1"
        )


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0, per_parameter_seeds: bool = False) -> None:
    """Random weights (as vLLM's dummy format): small uniform values, norms at 1, drawn on the device.
    per_parameter_seeds (tensor parallelism): each parameter drawn from a generator seeded by its name,
    so the parameters every rank holds whole (norms, the MoE router) are the same on every rank."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            if per_parameter_seeds:
                generator.manual_seed(seed + zlib.crc32(name.encode()))
            param.uniform_(-0.05, 0.05, generator=generator)
