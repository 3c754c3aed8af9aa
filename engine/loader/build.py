"""Build a model on its device and fill it from a ModelSource (or with random weights)."""

from __future__ import annotations

import logging
import time

import torch

from engine.errors import ModelLoadError
from engine.loader.resolve import ModelSource
from engine.loader.weights import gguf_weights, safetensors_names, safetensors_weights
from engine.model_config import ModelConfig
from engine.loader.param_loading import attach_weight_loaders
from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
    quantization: str = "auto",
) -> tuple[CausalLM, ModelConfig]:
    """quantization: "auto" (the checkpoint's own: FP8 layers stay FP8), "fp8" (also quantize a dense
    checkpoint's linears at load), "none" (FP8 checkpoints dequantized to `dtype`), "gguf" (the CPU
    platform keeps GGUF blocks later; nothing here)."""
    # Imported here: engine.quantization needs engine.layers, which imports this package's loaders.
    from engine.quantization.checkpoint import checkpoint_quantization, make_fp8_layers, rename_scales
    from engine.quantization.fp8 import dequantize_fp8_linears, quantize_linears_online

    config = ModelConfig.from_hf(source.hf_config)
    start = time.perf_counter()
    quant = None
    if source.kind == "hf" and load_format != "dummy":
        quant = checkpoint_quantization(source.hf_config, safetensors_names(source.path))
    if quantization == "fp8" and source.kind == "gguf":
        raise ModelLoadError(f"{source.path}: --quantization fp8 takes a safetensors checkpoint or a preset, not a GGUF file")
    # Built on the meta device, then materialised once on the target: no wasted random init.
    with torch.device("meta"):
        model = config.model_class(config)
    model = model.to(dtype=dtype)
    if quant is not None:
        layers = make_fp8_layers(model, quant)
        logger.info("checkpoint quantization %s: %d linear layers in FP8 (e4m3, %s scales)", quant.source, layers,
                    "128x128 block" if quant.block_scale else "per-tensor/channel")
    model = model.to_empty(device=device)
    attach_weight_loaders(model)  # materialising made new parameter objects
    model.after_materialize()
    if load_format == "dummy" or source.kind == "preset":
        if source.kind == "preset" and load_format != "dummy":
            raise ModelLoadError(f"{source.path}: a preset has no weights; pass --load-format dummy")
        fill_dummy_weights(model)
    elif source.kind == "gguf":
        with torch.no_grad():
            model.load_weights(gguf_weights(source.path, source.hf_config))
    else:
        weights = safetensors_weights(source.path)
        with torch.no_grad():
            model.load_weights(rename_scales(weights, quant) if quant is not None else weights)
    model.eval().requires_grad_(False)
    if quant is not None and quantization == "none":
        logger.info("--quantization none: %d FP8 layers dequantized to %s at load", dequantize_fp8_linears(model, dtype), dtype)
    elif quantization == "fp8" and quant is None:
        saved = quantize_linears_online(model)
        logger.info("--quantization fp8: linear weights quantized to FP8 e4m3 per output channel at load "
                    "(the LM head stays %s), %.0f MiB saved", dtype, saved / 2**20)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the KV pool is sized from free memory next
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM params, %s) on %s in %.2f s",
        config.model_type, source.kind if load_format != "dummy" else "dummy", params / 1e6, dtype, device,
        time.perf_counter() - start,
    )
    return model, config


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights (as vLLM's dummy format): small uniform values, norms at 1, drawn on the device."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.uniform_(-0.05, 0.05, generator=generator)
