"""XLA platform through torchax (PyTorch on JAX). RUN ON JAX'S CPU BACKEND ONLY; NEVER RUN ON A TPU.

The engine's own tensors (requests' rows, page tables, sampling) stay on the host, as on the CPU platform;
the model's steps run as XLA programs (backends/xla/programs.py) over JAX copies of the weights and a KV
cache that lives in JAX, donated to every program so XLA updates it in place. One program per decode
bucket (capture_sizes: batch sizes) and one per prefill bucket (extend_capture_tokens: token counts), all
compiled at start-up and none after (tests/test_xla.py holds it to JAX's own compile counters).

GGUF checkpoints are dequantized to the model dtype at load (runs_gguf_blocks is off): XLA has no kernel for
GGUF's blocks. Why torchax and not torch-xla: docs/xla.md.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from backends.xla.vendor import load, missing_modules
from engine.errors import EngineError
from engine.platform import CaptureKind, CaptureSettings, MemoryInfo, Platform

if TYPE_CHECKING:
    from backends.xla.attention import XlaAttentionBackend
    from backends.xla.programs import XlaPrograms
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_BUCKETS = [64, 256]


class XlaPlatform(Platform):
    name = "xla"
    # The engine's tensors are host tensors; only the step programs' arrays are JAX's (on its default backend).
    device_type = "cpu"
    serve_engine_in_own_process = False  # JAX on the CPU shares the host's cores with the server anyway
    runs_gguf_blocks = False  # GGUF blocks are dequantized at load: XLA has no kernel for them

    def __init__(self) -> None:
        self._reason: str | None = None
        self._prefill_buckets = list(DEFAULT_PREFILL_BUCKETS)
        self._programs: XlaPrograms | None = None

    # ---- device and availability -------------------------------------------------
    def is_available(self) -> bool:
        if missing_modules():
            self._reason = None
            return False
        try:
            load()
        except Exception as exc:  # an incompatible torchax or jax: say which, rather than "not available"
            self._reason = f"torchax/jax failed to import: {type(exc).__name__}: {exc}"
            return False
        return True

    def unavailable_reason(self) -> str:
        if self._reason:
            return self._reason
        try:
            load()
        except Exception as exc:
            return str(exc)
        return "device 'xla' is available"

    def device_facts(self) -> dict[str, str]:
        vendor = load()
        device = vendor.jax.devices()[0]
        return {
            "xla_device": f"{device.platform}:{device.device_kind}",
            "jax": vendor.jax.__version__,
            "torchax": str(getattr(vendor.torchax, "__version__", "?")),
        }

    def memory_info(self) -> MemoryInfo:
        # JAX's CPU backend allocates from host memory (an accelerator's memory_stats() would go here).
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(pages * page_size, os.sysconf("SC_AVPHYS_PAGES") * page_size)

    # ---- attention, dtype -------------------------------------------------------------
    def attention_backend(self) -> XlaAttentionBackend:
        from backends.xla.attention import XlaAttentionBackend

        return XlaAttentionBackend()

    def dtype_for_checkpoint(self, source_kind: str, quantization: str) -> str | None:
        """GGUF: float32, the dtype `--device cpu` runs it in, so both give the same greedy text."""
        return "float32" if source_kind == "gguf" else None

    def default_dtype(self, max_batch: int = 1) -> torch.dtype:
        # XLA's CPU backend has no native bf16 matmul here; float32 is faster and matches the CPU platform.
        return torch.float32

    # ---- configuration ---------------------------------------------------------------
    def configure(self, config: EngineConfig) -> None:
        """Refuse what would take a step off the XLA programs (the eager runner reads the host pool, which
        the programs never fill); read the prefill buckets."""
        if config.disable_graphs:
            raise EngineError("--device xla runs its compiled programs only; --disable-graphs is not supported")
        if config.mixed_steps:
            raise EngineError("--device xla: mixed steps are not supported; use --no-mixed-steps")
        if config.tensor_parallel_size > 1:
            raise EngineError("--device xla: tensor parallelism is not built for XLA")
        if config.enable_lora or config.lora_modules:
            raise EngineError("--device xla: LoRA is not built for XLA (its row buffers are host tensors)")
        if config.enable_hierarchical_cache:
            raise EngineError("--device xla: the host KV tier copies the host pool, which XLA does not use")
        buckets = config.extend_capture_tokens
        if isinstance(buckets, str):
            buckets = [int(b) for b in buckets.split(",") if b.strip()]
        if buckets:
            self._prefill_buckets = sorted({int(b) for b in buckets})

    # ---- capture ---------------------------------------------------------------------
    def capture_settings(self) -> CaptureSettings:
        return CaptureSettings(kind=CaptureKind.XLA)

    def programs_for(
        self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], page_size: int, max_pages: int
    ) -> XlaPrograms:
        """The engine's one XlaPrograms (weights and KV cache in JAX), shared by its decode and prefill runners."""
        if self._programs is None:
            from backends.xla.programs import XlaPrograms

            self._programs = XlaPrograms(model, kv_caches, page_size, max_pages)
        return self._programs

    def graph_runner_class(self) -> type:
        from backends.xla.runners import XlaDecodeRunner

        return XlaDecodeRunner

    def decode_runner_options(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        extend_layer_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, object]:
        return {"programs_for": self.programs_for}

    def prefill_runner_class(self) -> Callable[..., Any]:
        from backends.xla.runners import XlaPrefillRunner

        return functools.partial(
            XlaPrefillRunner.from_engine, programs_for=self.programs_for, buckets=self._prefill_buckets
        )
