"""The Platform interface every backend implements.

A Platform answers "what is this device and how do we capture graphs on it";
it knows nothing about models or requests. Vendor modules (torch_npu,
habana_frameworks, triton) are imported lazily inside each backend so that
`import backends` works on any machine.
"""

from __future__ import annotations

import abc
import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv_host_tier import PageMover
    from engine.layers.attention import AttentionBackend, AttentionMetadata
    from engine.lora.matmul import LoRAKernels

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
CACHE_DIR_ENV = "ENGINE_CACHE_DIR"  # a location, not a behaviour: tests point it at a temporary directory


def cache_dir(*parts: str) -> str:
    """Where the engine keeps what it builds or measures once (native kernels, the CPU's dtype probe, GGUF
    metadata): ENGINE_CACHE_DIR, else ~/.cache/graph-engine."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "graph-engine")
    return os.path.join(root, *parts)


class DeviceUnavailableError(RuntimeError):
    """The requested device is unknown or not present on this machine."""


@dataclass
class MemoryInfo:
    total_bytes: int
    free_bytes: int


class CaptureKind(enum.StrEnum):
    """The mechanism a platform captures steps with (a str: tuning reports store it as text)."""

    CUDA_GRAPH = "cuda_graph"  # torch.cuda.CUDAGraph (CUDA and HIP), one memory pool, largest size first
    COMPILE = "compile"  # torch.compile with static shapes, one compiled entry per size
    HPU_GRAPH = "hpu_graph"  # HPU lazy mode's graphs per bucket
    NPU_GRAPH = "npu_graph"  # torch.npu.NPUGraph (aclgraph) with host-side updates
    XLA = "xla"  # jax.jit programs per bucket through torchax, KV cache donated (backends/xla/)
    NONE = "none"  # every step eager


@dataclass
class CaptureSettings:
    """How a platform turns a step function into something replayable."""

    kind: CaptureKind
    compile_backend: str | None = None  # torch.compile backend name for compile-based capture
    compile_options: dict[str, Any] = field(default_factory=dict)
    # A captured step may call an op that reads device values on the host (the CPU's compiled graphs run on
    # the host and call such an op between their pieces); a device graph replays kernels only, so a model
    # with such an op (MoE's torch experts) runs eagerly there.
    host_syncs_ok: bool = False


class DeviceGraphs(Protocol):
    """Device graphs for work outside the step runners (the EAGLE-3 head's draft loop): a function of
    persistent tensors captured once and replayed, with none of its ops launched from the host again."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run fn to warm it up, capture its device work, and return what replays it. fn may read and write
        only tensors that outlive the graph (what it allocates lives in the platform's graph pool, reused by
        the next graph captured), must not read device values on the host, and runs in no other stream's
        work: replays are ordered on the current stream."""
        ...


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
    # Has kernels for GGUF's quantized blocks, so --quantization gguf keeps them (elsewhere they are dequantized).
    runs_gguf_blocks: bool = False
    # Pads every step to a bucket of shapes (HPU, as vllm-gaudi): capture-size tuning tunes its bucket
    # ranges, not a list of decode batch sizes.
    bucketed_steps: bool = False
    # `engine serve` runs the engine in a process of its own unless told otherwise: on an accelerator the
    # server's event loop then never waits on the device; on the host they would only share its cores.
    serve_engine_in_own_process: bool = True
    # How `engine serve --data-parallel-size N` shares the machine between replicas: "devices" (one device
    # each, chosen through the `visible_devices_env` variable, and one Ray GPU each), "cores" (a block of CPU
    # cores each), or None where replicas have not been built for this platform.
    replica_share: str | None = None
    visible_devices_env: str | None = None

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

    def device_count(self) -> int | None:
        """Devices this process can see; None on the host, where every tensor-parallel rank shares it."""
        return None

    def set_device(self, index: int) -> None:
        """Make device `index` the current one for this process (a tensor-parallel rank's accelerator)."""

    def device_facts(self) -> dict[str, str]:
        """What a measurement report names this machine's device by (the GPU's name and runtime); none here."""
        return {}

    # ---- memory -------------------------------------------------------------------
    @abc.abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Total and free memory of the device, used to size the KV pool."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    # ---- attention and KV ----------------------------------------------------------
    @abc.abstractmethod
    def attention_backend(self) -> AttentionBackend:
        """The attention backend (engine.layers.attention.AttentionBackend) used on this device."""

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

    def kv_page_mover(self) -> PageMover | None:
        """How the host KV tier moves pages of every layer at once (engine/kv_host_tier.py); None: one torch
        gather or scatter per layer and tensor."""
        return None

    def lora_kernels(self) -> LoRAKernels | None:
        """The batched LoRA matmul that reads only each row's adapter slot (engine/lora/matmul.py); None: the
        engine's dense torch path, whose cost grows with the number of slots."""
        return None

    def prepare_draft_module(self, module: torch.nn.Module) -> None:
        """Give a draft module's dense linears (an EAGLE-3 head's) the platform's kernels for the few rows
        a draft step has, as prepare_model does for the target's; nothing by default."""

    def device_graphs(self) -> DeviceGraphs | None:
        """Device graphs for work beside the step runners; None: that work runs eagerly (the host launches
        each op)."""
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

    def decode_runner_options(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        extend_layer_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, object]:
        """The keyword arguments of this platform's graph_runner_class() beyond the common ones, from the
        engine's config (the engine and the capture-size tuner build runners with them). extend_layer_fn: the
        compiled extend step's layer graph, which a decode runner may compile once for both. None here."""
        return {}

    def max_captured_graphs(self, num_layers: int, device_config: Mapping[str, Any]) -> int | None:
        """How many decode sizes this device can hold captured for a model of num_layers layers (NPU: aclgraph's
        streams); None: no limit but memory."""
        return None

    def prefill_runner_class(self) -> Callable[..., Any] | None:
        """A factory of this platform's prefill runner (a StepRunner of graphs/step_runner.py), called as
        ``factory(model, kv_caches, page_size, max_model_len, device, slot_dtype)``; None (the default):
        extend steps run through the engine's own eager, compiled or graphed extend path."""
        return None

    # ---- configuration ---------------------------------------------------------------
    def configure(self, config: EngineConfig) -> None:
        """The engine's resolved config, before anything is built: a platform with settings of its own (a
        section of its YAML, e.g. hpu:) takes them from config.device_config here. Nothing by default."""

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
