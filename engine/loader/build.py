"""Build a model on its device and fill it from a ModelSource (or with random weights)."""

from __future__ import annotations

import logging
import time

import torch

from engine.errors import ModelLoadError
from engine.loader.resolve import ModelSource
from engine.loader.weights import gguf_weights, safetensors_weights
from engine.model_config import ModelConfig
from engine.loader.param_loading import attach_weight_loaders
from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, load_format: str = "auto"
) -> tuple[CausalLM, ModelConfig]:
    config = ModelConfig.from_hf(source.hf_config)
    start = time.perf_counter()
    # Built on the meta device, then materialised once on the target: no wasted random init.
    with torch.device("meta"):
        model = config.model_class(config)
    model = model.to(dtype=dtype).to_empty(device=device)
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
        with torch.no_grad():
            model.load_weights(safetensors_weights(source.path))
    model.eval().requires_grad_(False)
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
