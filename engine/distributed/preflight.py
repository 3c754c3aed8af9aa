"""What rank 0 checks before it spawns any worker: one clear error rather than N failing processes."""

from __future__ import annotations

from typing import Any

from engine.distributed.sharding import check_tensor_parallel
from engine.errors import EngineError
from engine.platform import Platform


def check_launch(config: Any, platform: Platform, source: Any, model_config: Any) -> None:
    """The engine config (EngineConfig, resolved), the platform, the ModelSource and its ModelConfig."""
    world = int(config.tensor_parallel_size)
    if config.speculative_config:
        raise EngineError(f"--speculative-config with --tensor-parallel-size {world} > 1 is not supported yet")
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
    available = platform.device_count()  # None: the host, which every rank shares
    if available is not None and world > available:
        raise EngineError(
            f"--tensor-parallel-size {world} needs {world} {platform.name} devices (one per rank); this "
            f"machine has {available}"
        )
    check_tensor_parallel(model_config, world)
