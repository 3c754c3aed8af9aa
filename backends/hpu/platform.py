"""Intel Gaudi (HPU) platform, against habana_frameworks.torch. UNTESTED ON GAUDI HARDWARE.

habana_frameworks is imported lazily, inside methods, so `import backends.hpu`
works on any machine. Capture on Gaudi is shape-bucketed: every decode step is
padded to a (batch_size, num_blocks) bucket (backends/hpu/bucketing.py) and every
bucket is warmed up before serving (backends/hpu/graph_runner.py), in one of two
modes:

- ``compile`` (PT_HPU_LAZY_MODE=0, the eager + torch.compile path):
  ``torch.compile(step, backend="hpu_backend", dynamic=False)``; one compiled
  entry per bucket, so dynamo's recompile limit is raised to the bucket count.
- ``lazy`` (PT_HPU_LAZY_MODE=1): the step wrapped with
  ``habana_frameworks.torch.hpu.wrap_in_hpu_graph(module, disable_tensor_cache=True)``,
  one HPU graph recorded per input shape, ``mark_step()`` after each step.

The mode follows ENGINE_HPU_GRAPH_MODE (compile | lazy | eager), else
``hpu.graph_mode`` in configs/hpu.yaml, else what the bridge reports
(``habana_frameworks.torch.utils.internal.is_lazy()``), else PT_HPU_LAZY_MODE.

Habana runtime settings worth knowing (set them before the process imports
habana_frameworks; this module never sets them for you):

- PT_HPU_LAZY_MODE=0|1: eager/torch.compile (0) or lazy graph mode (1).
- PT_HPU_ENABLE_LAZY_COLLECTIVES=true: required for HPU graphs with
  tensor-parallel collectives (HCCL) in lazy mode.
- PT_HPU_RECIPE_CACHE_CONFIG=<dir>,<delete_at_start:true|false>,<max_MB>: keep
  compiled recipes on disk so the next start skips most of warm-up, e.g.
  ``/data/recipes,false,16384``; one directory per rank.
- PT_HPUGRAPH_DISABLE_TENSOR_CACHE=1: the env form of disable_tensor_cache.
- PT_HPU_WEIGHT_SHARING=0: often set for inference so weights are not duplicated.
- HABANA_VISIBLE_DEVICES / HABANA_VISIBLE_MODULES: which cards a process sees.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from backends.base import CaptureSettings, DeviceUnavailableError, MemoryInfo, Platform

GRAPH_MODES = ("compile", "lazy", "eager")


def graph_mode_from_env(env: Mapping[str, str] | None = None, default: str | None = None) -> str:
    """Pure: the capture mode chosen by ENGINE_HPU_GRAPH_MODE, then `default`, then PT_HPU_LAZY_MODE."""
    env = os.environ if env is None else env
    mode = (env.get("ENGINE_HPU_GRAPH_MODE") or default or "").strip().lower()
    if not mode:
        mode = "lazy" if env.get("PT_HPU_LAZY_MODE", "0").strip() in ("1", "true") else "compile"
    if mode not in GRAPH_MODES:
        raise ValueError(f"ENGINE_HPU_GRAPH_MODE must be one of {GRAPH_MODES}, got {mode!r}")
    return mode


class HpuPlatform(Platform):
    """Gaudi 2/3 through the Intel Gaudi PyTorch bridge (habana_frameworks.torch)."""

    name = "hpu"
    device_type = "hpu"
    dist_backend = "hccl"
    slot_index_dtype = torch.int64  # index_copy_ wants int64 indices

    def __init__(self, graph_mode: str | None = None) -> None:
        self._graph_mode = graph_mode
        self._reason: str | None = None

    # ---- device and availability -------------------------------------------------
    def is_available(self) -> bool:
        try:
            import habana_frameworks.torch  # noqa: F401  (registers torch.hpu and "hpu_backend")
        except ImportError as exc:
            self._reason = (
                f"habana_frameworks.torch is not importable ({exc}); install the Intel Gaudi "
                "PyTorch bridge (Gaudi software suite) on a machine with Gaudi cards"
            )
            return False
        except Exception as exc:  # the bridge raises RuntimeError when no card or driver is found
            self._reason = f"habana_frameworks.torch failed to initialise: {exc}"
            return False
        hpu = getattr(torch, "hpu", None)
        if hpu is None or not hpu.is_available() or hpu.device_count() < 1:
            self._reason = "habana_frameworks.torch is installed but no Gaudi device is visible (HABANA_VISIBLE_DEVICES?)"
            return False
        self._reason = None
        return True

    def unavailable_reason(self) -> str:
        if self.is_available():
            return "device 'hpu' is available"
        return self._reason or "device 'hpu' is not available on this machine"

    def graph_mode(self) -> str:
        """compile | lazy | eager; see the module docstring for the precedence."""
        if self._graph_mode is not None:
            return graph_mode_from_env(default=self._graph_mode)
        if os.environ.get("ENGINE_HPU_GRAPH_MODE"):
            return graph_mode_from_env()
        try:
            from habana_frameworks.torch.utils.internal import is_lazy

            return "lazy" if is_lazy() else "compile"
        except ImportError:
            return graph_mode_from_env()

    # ---- memory -------------------------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        self.check_available()
        hpu: Any = torch.hpu
        if hasattr(hpu, "mem_get_info"):
            free, total = hpu.mem_get_info()
            return MemoryInfo(total_bytes=int(total), free_bytes=int(free))
        # Older bridges: memory_stats() reports the allocator's Limit and InUse bytes.
        from habana_frameworks.torch.hpu import memory_stats

        stats = memory_stats()
        return MemoryInfo(total_bytes=int(stats["Limit"]), free_bytes=int(stats["Limit"] - stats["InUse"]))

    def synchronize(self) -> None:
        torch.hpu.synchronize()

    # ---- attention and KV ----------------------------------------------------------
    def attention_backend(self) -> Any:
        # The portable torch-ops backend; a Gaudi-native paged attention over the
        # flattened block list (bucketing.build_block_metadata) would plug in here.
        from engine.layers.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()

    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_indices: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """index_copy_ along slots. Shapes are static per bucket (padded rows write slot 0),
        so this lowers to one recipe per bucket rather than one per batch."""
        index = slot_indices if slot_indices.dtype == torch.int64 else slot_indices.to(torch.int64)
        k_cache.index_copy_(0, index, k.reshape(index.shape[0], *k_cache.shape[1:]))
        v_cache.index_copy_(0, index, v.reshape(index.shape[0], *v_cache.shape[1:]))

    # ---- capture ---------------------------------------------------------------------
    def capture_settings(self) -> CaptureSettings:
        mode = self.graph_mode()
        if mode == "lazy":
            return CaptureSettings(
                kind="hpu_graph",
                compile_options={"wrap_in_hpu_graph": True, "disable_tensor_cache": True},
            )
        if mode == "eager":
            return CaptureSettings(kind="none")
        return CaptureSettings(
            kind="compile",
            compile_backend="hpu_backend",
            compile_options={"dynamic": False, "fullgraph": False, "wrap_in_hpu_graph": False},
        )

    def graph_runner_class(self) -> type:
        from backends.hpu.graph_runner import HpuDecodeRunner

        return HpuDecodeRunner

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        hpu: Any = getattr(torch, "hpu", None)
        if hpu is not None and hasattr(hpu, "manual_seed"):
            hpu.manual_seed(seed)


def require_hpu() -> HpuPlatform:
    """The platform, or DeviceUnavailableError with the reason."""
    platform = HpuPlatform()
    if not platform.is_available():
        raise DeviceUnavailableError(platform.unavailable_reason())
    return platform
