"""CUDA platform: CUDA graphs over the whole decode step, Triton decode attention."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from backends.cuda.triton_penalties import apply_penalties_
from engine.platform import CaptureKind, CaptureSettings, DeviceGraphs, MemoryInfo, Platform
from engine.sampler import PENALTY_KERNELS

if TYPE_CHECKING:
    from backends.cuda.triton_attention import TritonAttentionBackend
    from engine.config import EngineConfig
    from engine.kv_host_tier import PageMover
    from engine.lora.matmul import LoRAKernels

# The sampler's penalties on CUDA (and HIP: torch's "cuda" device type) tensors: one Triton launch a batch.
PENALTY_KERNELS["cuda"] = apply_penalties_

logger = logging.getLogger(__name__)

# What inductor's first compile imports (torch 2.11-2.13: compile_fx alone brings ~500 modules; 3.25 s on the
# H200's host with a cold page cache), imported in the warm-up thread while the model loads instead of on the
# main thread inside the capture (which then imported 334 modules; 159-163 with this).
# Only inductor's own modules: nothing the model load imports too (transformers, torch.distributed), so the
# two threads never import one package at once.
COMPILER_MODULES = (
    "torch._inductor.compile_fx",
    "torch._inductor.codegen.cuda_combined_scheduling",
    "torch._inductor.codegen.wrapper_fxir",
    "torch._dynamo.backends.inductor",
)


def inductor_pool_ready() -> bool | None:
    """Whether inductor's compile workers have answered their first job; None where no pool was started (one
    compile thread). Until they have, inductor compiles each kernel it generates on the calling thread."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return None
    future = AsyncCompile._ready_future
    return None if future is None else future.done()


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    replica_share = "devices"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    dist_backend = "nccl"
    # One-row linears through the Triton GEMV where the H200 measured it faster than cuBLAS (backends/cuda/gemv.py).
    one_row_gemv = True
    pads_logit_rows = True  # measured on the H200 (engine/logit_rows.py); ROCm inherits it, unmeasured there

    def is_available(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def unavailable_reason(self) -> str:
        if torch.version.cuda is None and torch.version.hip is None:
            return f"device '{self.name}' is not available: this torch build ({torch.__version__}) has no CUDA support"
        return f"device '{self.name}' is not available: no GPU visible to this torch build ({torch.__version__})"

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info()
        return MemoryInfo(total, free)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def device_count(self) -> int | None:
        return int(torch.cuda.device_count())

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def device_facts(self) -> dict[str, str]:
        if not torch.cuda.is_available():
            return {}
        return {"gpu": torch.cuda.get_device_name(), "cuda": str(torch.version.cuda or torch.version.hip)}

    def attention_backend(self) -> TritonAttentionBackend:
        from backends.cuda.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()

    def prepare_model(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        from backends.cuda.gemv import use_gemv
        from backends.cuda.moe_method import use_fused_moe

        if layers := use_fused_moe(model):
            logger.info("MoE: %d layers run the fused Triton experts kernel (capturable in CUDA graphs)", layers)
        if self.one_row_gemv and (layers := use_gemv(model)):
            logger.info("GEMV: %d dense linears take one-row inputs (batch-1 decode) through the Triton GEMV", layers)

    def fp8_linear_method(self):
        """Hopper and newer (compute capability 8.9+: FP8 tensor cores and e4m3 conversions): the Triton
        weight-only kernel at decode batch sizes, torch._scaled_mm above (backends/cuda/fp8_linear.py)."""
        if torch.cuda.get_device_capability() < (8, 9):
            logger.warning(
                "FP8 kernels need compute capability 8.9+ (this GPU: %s)", torch.cuda.get_device_capability()
            )
            return None
        from backends.cuda.fp8_linear import CUDA_FP8

        return CUDA_FP8

    def kv_page_mover(self) -> PageMover:
        """One Triton launch per staged chunk for the pages of every layer (backends/cuda/kv_pages.py)."""
        from backends.cuda.kv_pages import TRITON_PAGE_MOVER

        return TRITON_PAGE_MOVER

    def prepare_draft_module(self, module: torch.nn.Module) -> None:
        """A draft step of one request is one row: the head's linears take the Triton GEMV as the target's do."""
        from backends.cuda.gemv import use_gemv

        if self.one_row_gemv and (layers := use_gemv(module)):
            logger.info("GEMV: %d linears of the draft head take one-row inputs through the Triton GEMV", layers)

    def device_graphs(self) -> DeviceGraphs:
        """CUDA graphs over one pool of their own (backends/cuda/device_graphs.py)."""
        from backends.cuda.device_graphs import CudaDeviceGraphs

        return CudaDeviceGraphs()

    def lora_kernels(self) -> LoRAKernels:
        """The grouped Triton kernels (backends/cuda/lora.py): each block of rows reads only its own slot's A
        and B, inside the captured graphs."""
        from backends.cuda.lora import TRITON_LORA

        return TRITON_LORA

    def capture_settings(self) -> CaptureSettings:
        return CaptureSettings(kind=CaptureKind.CUDA_GRAPH)

    def start_compile_workers(self) -> None:
        """Inductor compiles its Triton kernels in a pool of worker processes, which it starts at the first
        compile; until they are up (a process that imports torch and initialises CUDA, then forks the workers:
        ~8 s on the H200's host with a cold page cache) the kernels compile one by one in this process.
        Started here, before the engine sets up the device and loads the model, the pool is ready when the
        decode step compiles; so is Triton's runtime, readied in a thread (triton_build.start_runtime_warm_up),
        which then imports inductor's compiler (COMPILER_MODULES). The thread starts once this thread's own
        imports here are done (dynamo, the pool, triton), so the two never import one module at once."""
        from backends.cuda.triton_build import start_runtime_warm_up

        try:
            from torch._inductor.async_compile import maybe_warm_pool
        except ImportError:  # a torch without inductor's pool: it compiles in-process, nothing to start
            maybe_warm_pool = None
        if maybe_warm_pool is not None:
            started = time.perf_counter()
            maybe_warm_pool()
            logger.info(
                "inductor compile workers starting in the background (%.2f s to launch)", time.perf_counter() - started
            )
        start_runtime_warm_up(also_import=COMPILER_MODULES)

    def wait_for_compile_workers(self) -> None:
        """Join the warm-up thread; say whether inductor's worker pool is up (it is not waited for: the kernels
        it would compile in parallel cost ~1 s more on this thread, and its start-up ~8 s on the H200's host)."""
        from backends.cuda.triton_build import wait_for_runtime_warm_up

        wait_for_runtime_warm_up()
        if (ready := inductor_pool_ready()) is not None:
            logger.info(
                "inductor compile workers %s",
                "ready" if ready else "still starting: inductor compiles its first kernels on this thread, one by one",
            )

    def kernel_precompiler(self, model: torch.nn.Module, kv_caches: list) -> Any:
        """The attention kernels, the one-row GEMVs and the LoRA kernels compile in worker threads while dynamo
        and inductor compile the decode step (each was 1-2 s of a cold capture, one after another)."""
        from backends.cuda.gemv import precompile_gemv
        from backends.cuda.lora import precompile_lora
        from backends.cuda.triton_build import BackgroundCompiles

        backend = model.attention_backend

        def start(decode_metas: list) -> Any:
            background = BackgroundCompiles()
            if not background.active:
                return background.finish
            try:
                launches = backend.precompile_kernels(model, kv_caches, decode_metas) if backend is not None else 0
                launches += precompile_gemv(model) if self.one_row_gemv else 0
                launches += precompile_lora(model)
                logger.info("compiling %d kernel variants in the background while the decode step compiles", launches)
            except Exception as exc:
                logger.warning(
                    "background kernel compiles not started (%s: %s); kernels compile at first launch",
                    type(exc).__name__,
                    exc,
                )
            return background.finish

        return start

    def graph_runner_class(self) -> type:
        from graphs.cuda_graph_runner import CudaGraphRunner

        return CudaGraphRunner

    def decode_runner_options(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        extend_layer_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, object]:
        """The decode step compiled before capture (compile_decode), sharing the compiled extend step's layer
        graph where there is one; this platform's kernels compile in the background meanwhile."""
        return {
            "compile_step": bool(config.compile_decode),
            "precompile": self.kernel_precompiler(model, kv_caches),
            "layer_fn": extend_layer_fn,
        }

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
