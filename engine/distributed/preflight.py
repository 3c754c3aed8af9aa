"""What rank 0 checks before it spawns any worker: one clear error rather than N failing processes."""

from __future__ import annotations

from typing import Any

import torch

from engine.distributed.sharding import check_tensor_parallel
from engine.errors import EngineError


def device_count(platform: Any) -> int | None:
    """Accelerators this process can see (None: the CPU, where every rank shares the host)."""
    if platform.device_type == "cpu":
        return None
    module = getattr(torch, platform.device_type, None)
    return int(module.device_count()) if module is not None and hasattr(module, "device_count") else 0


def check_launch(config: Any, platform: Any, source: Any, model_config: Any) -> None:
    """The engine config (EngineConfig, resolved), the platform, the ModelSource and its ModelConfig."""
    world = int(config.tensor_parallel_size)
    if source.kind == "gguf":
        raise EngineError(
            f"--tensor-parallel-size {world}: a GGUF model cannot be split over ranks (its blocks are not "
            "sharded); use a safetensors checkpoint or --tensor-parallel-size 1"
        )
    if config.quantization in ("fp8", "gguf"):
        raise EngineError(
            f"--tensor-parallel-size {world} with --quantization {config.quantization}: quantized weights "
            "are not sharded yet; use --tensor-parallel-size 1"
        )
    available = device_count(platform)
    if available is not None and world > available:
        raise EngineError(
            f"--tensor-parallel-size {world} needs {world} {platform.name} devices (one per rank); this "
            f"machine has {available}"
        )
    check_tensor_parallel(model_config, world)
