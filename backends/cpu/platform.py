"""CPU platform: the development path, and a real one (AVX512/AMX make it usable)."""

from __future__ import annotations

import os
from typing import Any

import torch

from backends.base import CaptureSettings, MemoryInfo, Platform


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def memory_info(self) -> MemoryInfo:
        try:
            return MemoryInfo(_meminfo_bytes("MemTotal"), _meminfo_bytes("MemAvailable"))
        except (OSError, KeyError):
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            return MemoryInfo(pages * page_size, os.sysconf("SC_AVPHYS_PAGES") * page_size)

    def attention_backend(self):  # noqa: ANN201
        from backends.cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend()

    def prepare_model(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        from backends.cpu.packed_linear import onednn_packing_supported, pack_linear_weights

        dtype = next(model.parameters()).dtype
        if settings.get("onednn_packed_linear", True) and onednn_packing_supported(dtype):
            pack_linear_weights(model, batch_hint=int(settings.get("max_capture_size") or 16))

    def capture_settings(self) -> CaptureSettings:
        return CaptureSettings(kind="compile", compile_backend="inductor")

    def graph_runner_class(self) -> type:
        from graphs.compiled_runner import CompiledDecodeRunner

        return CompiledDecodeRunner

    def default_dtype(self) -> torch.dtype:
        # With oneDNN-packed weights, bfloat16 is the fastest at every batch size on CPUs
        # with native bf16 (AVX512-BF16 / AMX): half the bytes streamed per decode step.
        # Without it, bf16 is emulated and float32 wins.
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.bfloat16
        return torch.float32
