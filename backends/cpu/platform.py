"""CPU platform: the development path, and a real one (AVX512/AMX make it usable)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import EngineError
from engine.platform import CaptureKind, CaptureSettings, MemoryInfo, Platform

if TYPE_CHECKING:
    from backends.cpu.attention import CpuAttentionBackend
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    serve_engine_in_own_process = False
    replica_share = "cores"
    dist_backend = "gloo"
    runs_gguf_blocks = True  # backends/cpu/gguf_linear.py

    def is_available(self) -> bool:
        return True

    def memory_info(self) -> MemoryInfo:
        try:
            return MemoryInfo(_meminfo_bytes("MemTotal"), _meminfo_bytes("MemAvailable"))
        except (OSError, KeyError):
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            return MemoryInfo(pages * page_size, os.sysconf("SC_AVPHYS_PAGES") * page_size)

    def attention_backend(self) -> CpuAttentionBackend:
        from backends.cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend()

    def prepare_model(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        from backends.cpu.packed_linear import pack_linear_weights

        self._keep_gguf_blocks(model, settings)
        self._prefill_attention(model, settings)
        packed = 0
        if settings.get("onednn_packed_linear", True):
            # oneDNN picks its blocked layout for the batch sizes it will see: the largest captured one.
            packed = pack_linear_weights(model, batch_hint=max(settings.get("capture_sizes") or [16]))
        dtype = next(model.parameters()).dtype
        kv_dtype = settings.get("kv_cache_dtype", str(dtype).replace("torch.", ""))
        logger.info("CPU paths: %s", describe_cpu_paths(dtype, str(kv_dtype), packed > 0, self.dtype_reason))

    def dtype_for_checkpoint(self, source_kind: str, quantization: str) -> str | None:
        """GGUF blocks kept: float32. The kernels compute in float32, so bf16 activations only add
        conversions and bf16 elementwise ops (SmolLM2 Q4_1, batch 1: 63.7 tok/s in float32, 41.6 in bf16)."""
        if source_kind != "gguf" or quantization == "none":
            return None
        from backends.cpu.gguf_linear import gguf_kernels_available

        if not gguf_kernels_available():
            return None
        self.dtype_reason = "float32 for GGUF blocks (their kernels compute in float32)"
        return "float32"

    def _keep_gguf_blocks(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        """A GGUF model's linears keep their blocks (backends/cpu/gguf_linear.py) unless told otherwise."""
        mode, path = settings.get("quantization", "auto"), settings.get("gguf_path")
        if mode == "none" or path is None:
            if mode == "gguf":
                raise EngineError("--quantization gguf needs a GGUF model")
            return
        from backends.cpu.gguf_linear import describe_paths, gguf_kernels_available, keep_gguf_blocks

        if not gguf_kernels_available():
            if mode == "gguf":
                raise EngineError("--quantization gguf: the native GGUF kernels could not be built here (see the log)")
            logger.info("GGUF weights dequantized at load: no native GGUF kernel here")
            return
        activations = settings.get("gguf_activations", "auto")
        if activations == "auto":
            # Two int8 levels: integer dot products at ~16-bit activations. Measured on SmolLM2 Q4_1 (a 2-core
            # Xeon with AVX512-VNNI, docs/quantization.md): a native decode step of ~3.7 ms against ~9 ms with
            # float32 activations, logits within 3e-4 of the logit scale of the exact path and HF's greedy ids.
            activations = "int8x2"
        kept = keep_gguf_blocks(model, path, activations)
        logger.info(
            "GGUF weights kept in their blocks: %.1f MiB, %s activations (kernels: %s)",
            kept / 2**20,
            activations,
            describe_paths(),
        )
        self._prefill_weights(model, settings)

    def _prefill_weights(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        """Many-row steps on a packed bf16 copy where the CPU multiplies bf16 natively (prefill_weights.py)."""
        from backends.cpu import prefill_weights

        layers = prefill_weights.prefill_layers(model)
        needed = prefill_weights.copy_bytes(layers)
        keep, reason = prefill_weights.choose_prefill_weights(
            settings.get("cpu_prefill_weights") or "auto",
            needed,
            self.memory_info().free_bytes,
            settings.get("gguf_activations") or "auto",
        )
        added = 0
        if keep:
            start = time.perf_counter()
            # oneDNN picks its blocked layout for the rows it will see: a prefill step's token budget.
            added = prefill_weights.attach_prefill_weights(
                layers, settings.get("chunked_prefill_size") or settings.get("max_prefill_tokens") or 512
            )
            reason += f", packed in {time.perf_counter() - start:.1f} s"
            set_activations = getattr(model, "set_prefill_activations", None)
            if set_activations is not None:
                # Long steps' MLPs in bf16 too: the packed GEMMs take and give it (decoder.py).
                from backends.cpu.gguf_linear import PREFILL_BF16_ACTIVATION_ROWS as ROWS

                switched = set_activations(torch.bfloat16, ROWS, prefill_weights.has_copy)
                reason += f", the MLPs of {switched} layers in bf16 in steps of >= {ROWS} rows"
        logger.info("CPU %s", prefill_weights.describe(keep, reason, added))

    def _prefill_attention(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        """Prefill attention on the bf16 kernel where --cpu-prefill-attention picks it (attention.py)."""
        from backends.cpu.attention import PREFILL_BF16_ATTENTION_ROWS, CpuAttentionBackend, choose_prefill_attention
        from backends.cpu.prefill_weights import has_prefill_copy

        backend = getattr(model, "attention_backend", None)
        if not isinstance(backend, CpuAttentionBackend):
            return
        mode = settings.get("cpu_prefill_attention") or "auto"
        chosen, reason = choose_prefill_attention(mode, has_prefill_copy(model))
        rows = backend.bf16_prefill_rows = PREFILL_BF16_ATTENTION_ROWS if chosen else 0
        path = f"bf16 kernel in steps whose requests have >= {rows} new tokens each" if rows else "float32 SDPA"
        logger.info("CPU prefill attention: %s (%s)", path, reason)

    def capture_settings(self) -> CaptureSettings:
        # Compiled graphs run on the host: an op between their pieces may read device (host) values.
        return CaptureSettings(kind=CaptureKind.COMPILE, compile_backend="inductor", host_syncs_ok=True)

    def graph_runner_class(self) -> type:
        # The native GGUF step for the models it covers, the compiled graphs for the rest.
        from backends.cpu.gguf_decode import CpuDecodeRunner

        return CpuDecodeRunner

    def decode_runner_options(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        extend_layer_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, object]:
        """The compiled runner fails on a compile after warm-up only with --strict-graphs."""
        return {"strict": bool(config.strict_graphs)}

    dtype_reason = "requested"

    def default_dtype(self, max_batch: int = 1) -> torch.dtype:
        from backends.cpu.dtype_probe import choose_dtype

        choice = choose_dtype(max_batch)
        self.dtype_reason = f"chosen{' (cached)' if choice.cached else ''} by {choice.reason}"
        return getattr(torch, choice.dtype)


def describe_cpu_paths(dtype: torch.dtype, kv_dtype: str, packed: bool, dtype_reason: str) -> str:
    """One line: the ISA, the model dtype and why, and which kernel each hot op runs on."""
    from backends.cpu.attention import native_decode_available
    from backends.cpu.features import cpu_features
    from backends.cpu.packed_linear import GEMV_MAX_ROWS, _gemv_kernel

    name = str(dtype).replace("torch.", "")
    if packed:
        linear = f"oneDNN-packed {name}"
        if dtype == torch.bfloat16 and _gemv_kernel() is not None:
            linear += f" + native AVX512-BF16 GEMV at batch <= {GEMV_MAX_ROWS}"
    else:
        linear = f"F.linear {name} (oneDNN packing off or unsupported)"
    if kv_dtype == "float32" and native_decode_available():
        attention = "native paged kernel over a float32 KV cache"
    else:
        attention = f"torch ops over a {kv_dtype} KV cache"
    return (
        f"{cpu_features().describe()}, {torch.get_num_threads()} threads; model {name} ({dtype_reason}); "
        f"linear: {linear}; decode attention: {attention}"
    )


def forget_cpu_paths() -> None:
    """Drop the cached path choices, so the next engine re-reads the environment switches.

    For tests that switch the native kernels, oneDNN packing or CPU features off
    within one process; an engine already built keeps the paths it chose.
    """
    from backends.cpu import attention, features, gguf_linear, native, packed_linear

    for cached in (
        features.cpu_features,
        native.load,
        attention._kernel,
        attention._prefill_kernel,
        packed_linear._gemv_kernel,
        gguf_linear._library,
        gguf_linear.code_paths,
    ):
        cached.cache_clear()
