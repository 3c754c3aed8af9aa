"""The Platform interface every backend implements.

A Platform answers "what is this device and how do we capture graphs on it";
it knows nothing about models or requests. Vendor modules (torch_npu,
habana_frameworks, triton) are imported lazily inside each backend so that
`import backends` works on any machine.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.layers.attention import AttentionMetadata

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class DeviceUnavailableError(RuntimeError):
    """The requested device is unknown or not present on this machine."""


@dataclass
class MemoryInfo:
    total_bytes: int
    free_bytes: int


@dataclass
class CaptureSettings:
    """How a platform turns a step function into something replayable."""

    kind: str  # "cuda_graph" | "compile" | "hpu_graph" | "npu_graph" | "none"
    compile_backend: str | None = None  # torch.compile backend name for compile-based capture
    compile_options: dict[str, Any] = field(default_factory=dict)


class Platform(abc.ABC):
    """One accelerator family. Subclasses live in backends/<name>/platform.py."""

    name: str = "base"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    # dtype of slot indices fed to the KV store op (NPU's scatter wants int32).
    slot_index_dtype: torch.dtype = torch.int64
    # Pad the eager LM head's rows to a ladder warmed at start-up (engine/logit_rows.py): where a BLAS's first
    # matmul of a new row count waits for the whole device queue (cuBLAS on the H200).
    pads_logit_rows: bool = False

    # ---- device and availability -------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when this machine has the device and the torch build supports it."""

    def unavailable_reason(self) -> str:
        return f"device '{self.name}' is not available on this machine"

    def check_available(self) -> None:
        if not self.is_available():
            raise DeviceUnavailableError(self.unavailable_reason())

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    # ---- memory -------------------------------------------------------------------
    @abc.abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Total and free memory of the device, used to size the KV pool."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    # ---- attention and KV ----------------------------------------------------------
    @abc.abstractmethod
    def attention_backend(self) -> Any:
        """The AttentionBackend object (engine.layers.attention_backend) used on this device."""

    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_indices: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write k/v rows ([tokens, kv_heads, head_dim]) to cache slots ([slots, kv_heads, head_dim])."""
        k_cache.index_copy_(0, slot_indices, k)
        v_cache.index_copy_(0, slot_indices, v)

    def dtype_for_checkpoint(self, source_kind: str, quantization: str) -> str | None:
        """The model dtype this platform wants for this kind of checkpoint when the user asked for
        "auto" (None: the platform's general default stands)."""
        return None

    def prepare_model(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        """Device-specific weight preparation after loading (CPU: oneDNN-packed linears)."""

    def fp8_linear_method(self) -> Any:
        """The engine.layers.linear.LinearMethod FP8 linears run here; None: this platform has no FP8
        matmul kernel, and FP8 weights are dequantized once at load."""
        return None

    # ---- capture ---------------------------------------------------------------------
    @abc.abstractmethod
    def capture_settings(self) -> CaptureSettings:
        """Which capture mechanism this platform uses and its options."""

    def start_compile_workers(self) -> None:
        """Called as soon as the engine's config says a step will be torch.compile'd, before the device is set up
        and the model loads: start what the compiler needs (its worker processes) so that it is ready by the
        first compile. Nothing by default."""

    def wait_for_compile_workers(self) -> None:
        """Called once the weights are loaded, before anything compiles: wait for what start_compile_workers
        started that must not run beside a compile (a thread importing the compiler). Nothing by default."""

    def kernel_precompiler(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[[list[AttentionMetadata]], Callable[[], None]] | None:
        """A function the decode graph runner calls before its first compile: given the capture metadata
        of some sizes, it starts compiling the platform's own kernels in the background and returns the
        function that waits for them (called before the first graph is captured). None: nothing to do."""
        return None

    def graph_runner_class(self) -> type:
        """The graphs.* runner class that captures decode steps on this platform."""
        raise DeviceUnavailableError(f"platform '{self.name}' has no graph runner")

    def prefill_runner_class(self) -> Callable[..., Any] | None:
        """A factory of this platform's prefill runner (graphs/runner.py PrefillRunner), called as
        ``factory(model, kv_caches, page_size, max_model_len, device, slot_dtype)``; None (the default):
        extend steps run through the engine's own eager, compiled or graphed extend path."""
        return None

    # ---- configuration ---------------------------------------------------------------
    def default_config(self) -> str:
        """Path of configs/<name>.yaml with this platform's default settings."""
        return os.path.join(CONFIG_DIR, f"{self.name}.yaml")

    def default_dtype(self, max_batch: int = 1) -> torch.dtype:
        """The model dtype when the user asks for none; max_batch: the largest decode batch it will run."""
        return torch.bfloat16

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


def load_yaml_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at top level")
    return data


StepFn = Callable[..., torch.Tensor]
