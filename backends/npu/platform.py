"""Huawei Ascend (NPU) platform, against torch_npu. UNTESTED ON ASCEND HARDWARE.

torch_npu is imported lazily, inside methods, so `import backends.npu` works on
any machine. Importing torch_npu is what registers ``torch.npu`` (NPUGraph,
graph, graph_pool_handle, mem_get_info, ...).

Decode steps are captured as aclgraphs (``torch.npu.NPUGraph`` under
``torch.npu.graph``), largest size first into one shared pool
(backends/npu/graph_runner.py). KV writes use
``torch_npu.npu_scatter_nd_update_`` with int32 [tokens, 1] slot indices on each
layer's own cache tensor (backends/npu/kv_store.py explains the layout).

Ascend runtime settings worth knowing (set them before the process starts):

- ASCEND_RT_VISIBLE_DEVICES: which NPUs a process sees.
- HCCL_OP_EXPANSION_MODE=AIV: collectives use fewer streams, so more capture
  sizes fit under aclgraph's ~1800-graph limit (see npu_graph_budget).
- HCCL_BUFFSIZE: HCCL buffer size in MB per communicator.
- PYTORCH_NPU_ALLOC_CONF=expandable_segments:True: less fragmentation of the
  caching allocator across many captured sizes.
- TASK_QUEUE_ENABLE: torch_npu's task-queue level (launch overlap). Level 2 breaks NPU graph
  capture (torch_npu test/test_task_queue_enable.py expects capture_begin to raise there), so
  NpuEngineRunner refuses to capture at level 2; 1 (the default) or 0 work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from backends.npu.kv_store import slot_scatter_indices, store_kv_reference, updates_for
from engine.platform import (
    CaptureKind,
    CaptureSettings,
    DeviceUnavailableError,
    MemoryInfo,
    Platform,
    load_yaml_config,
)
from graphs.step_runner import DecodeStepRunner

if TYPE_CHECKING:
    from backends.npu.attention import NpuAttentionBackend
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)
MAX_ACLGRAPH_GRAPHS = 1800  # vllm-ascend: 2048 streams minus 248 kept in reserve


def torch_npu_version() -> str:
    """The installed torch_npu's version for error messages ("not installed" without it); never imports it
    for the first time (only reads it once something else has)."""
    import sys

    module = sys.modules.get("torch_npu")
    if module is None:
        return "(torch_npu not imported)"
    return str(getattr(module, "__version__", "unknown version"))


class NpuPlatform(Platform):
    """Ascend 910B/A2/A3 through torch_npu (with the CANN toolkit)."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    slot_index_dtype = torch.int32  # npu_scatter_nd_update_ indices; SGLang's NPU runner uses int32 too

    def __init__(self) -> None:
        self._reason: str | None = None

    # ---- device and availability -------------------------------------------------
    def is_available(self) -> bool:
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as exc:
            self._reason = (
                f"torch_npu is not importable ({exc}); install the torch-npu build matching this "
                f"torch ({torch.__version__}) and source the CANN toolkit's set_env.sh"
            )
            return False
        except Exception as exc:  # a broken CANN install raises at import (missing libascendcl.so, ...)
            self._reason = f"torch_npu failed to initialise: {exc}"
            return False
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available() or npu.device_count() < 1:
            self._reason = "torch_npu is installed but no Ascend NPU is visible (ASCEND_RT_VISIBLE_DEVICES?)"
            return False
        self._reason = None
        return True

    def unavailable_reason(self) -> str:
        if self.is_available():
            return "device 'npu' is available"
        return self._reason or "device 'npu' is not available on this machine"

    # ---- memory -------------------------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        self.check_available()
        free, total = torch.npu.mem_get_info()
        return MemoryInfo(total_bytes=int(total), free_bytes=int(free))

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def device_count(self) -> int | None:
        return int(torch.npu.device_count())

    def set_device(self, index: int) -> None:
        torch.npu.set_device(index)

    # ---- attention and KV ----------------------------------------------------------
    def attention_backend(self) -> NpuAttentionBackend:
        # npu_scatter_nd_update_ stores + torch_npu._npu_paged_attention decode (host context_lens,
        # refreshed per graph replay by NpuDecodeGraphRunner); see backends/npu/attention.py.
        from backends.npu.attention import NpuAttentionBackend

        return NpuAttentionBackend(self.store_kv)

    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_indices: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """npu_scatter_nd_update_ per layer: cache [slots, heads, dim], indices [tokens, 1] int32,
        updates [tokens, heads, dim]. Off-NPU tensors take the plain-torch reference path."""
        if k_cache.device.type != "npu":
            store_kv_reference(k_cache, v_cache, slot_indices, k, v)
            return
        import torch_npu

        indices = slot_scatter_indices(slot_indices)
        torch_npu.npu_scatter_nd_update_(k_cache, indices, updates_for(k_cache, indices, k))
        torch_npu.npu_scatter_nd_update_(v_cache, indices, updates_for(v_cache, indices, v))

    # ---- capture ---------------------------------------------------------------------
    def capture_settings(self) -> CaptureSettings:
        return CaptureSettings(
            kind=CaptureKind.NPU_GRAPH,
            compile_options={
                "graph_class": "torch.npu.NPUGraph",
                "capture_context": "torch.npu.graph",
                "shared_pool": True,  # torch.npu.graph_pool_handle(), largest size first
                "auto_dispatch_capture": True,  # lets NPUGraph.update() refresh host-side args
                "max_graphs": MAX_ACLGRAPH_GRAPHS,
            },
        )

    def graph_runner_class(self) -> type:
        # The engine-facing adapter below; NpuDecodeGraphRunner itself takes a step callable.
        return NpuEngineRunner

    def decode_runner_options(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        extend_layer_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, object]:
        """The engine's device config: the npu: section the runner reads (a --capture-config's included)."""
        return {"device_config": config.device_config}

    def max_captured_graphs(self, num_layers: int, device_config: Mapping[str, Any]) -> int | None:
        """Capture sizes aclgraph's streams hold for this layer count (npu_graph_budget, one communication-free
        rank; the npu: section's hccl_aiv and max_graphs)."""
        from backends.npu.graph_runner import npu_graph_budget

        npu = device_config.get("npu") or {}
        return npu_graph_budget(
            num_layers, 0, bool(npu.get("hccl_aiv", False)), int(npu.get("max_graphs", MAX_ACLGRAPH_GRAPHS))
        )

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        npu: Any = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "manual_seed"):
            npu.manual_seed(seed)


def require_npu() -> NpuPlatform:
    """The platform, or DeviceUnavailableError with the reason."""
    platform = NpuPlatform()
    if not platform.is_available():
        raise DeviceUnavailableError(platform.unavailable_reason())
    return platform


def model_step(
    model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], page_size: int
) -> Callable[..., torch.Tensor]:
    """The decode step over the engine's model, as the runners want it: forward through logits.

    `seq_lens_host` (NpuDecodeGraphRunner(pass_host_seq_lens=True)) is the host copy of
    seq_lens that _npu_paged_attention takes as context_lens; it reaches every layer as
    meta.platform_metadata, so no layer copies lengths off the device inside a graph.
    `workspace_context_len` (the captured run only) sizes the op's workspace for the longest context.
    """
    from backends.npu.attention import NpuDecodeMetadata
    from engine.layers.attention import AttentionMetadata

    workspaces: dict[tuple[Any, ...], torch.Tensor] = {}  # alive as long as the step (and its graphs)

    def step(
        input_ids,
        positions,
        slot_indices,
        page_table,
        seq_lens,
        seq_lens_host=None,
        workspace_context_len=0,
    ):
        extra = None
        if seq_lens_host is not None:
            extra = NpuDecodeMetadata(
                context_lens=seq_lens_host, workspace_context_len=int(workspace_context_len), workspaces=workspaces
            )
        meta = AttentionMetadata(
            is_decode=True,
            slot_indices=slot_indices,
            page_table=page_table,
            seq_lens=seq_lens,
            page_size=page_size,
            platform_metadata=extra,
        )
        return model.compute_logits(model(input_ids, positions, kv_caches, meta))

    return step


def attention_shapes(model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> set[tuple[int, int, int]]:
    """(heads, kv_heads, head_size) of every attention layer: from the model's Attention modules where it has
    them, else (heads unknown: taken equal to kv_heads) from the caches, [slots, kv_heads, head_size]."""
    from engine.layers.attention import Attention

    modules = getattr(model, "modules", None)
    found = (
        {(m.num_heads, m.num_kv_heads, m.head_dim) for m in modules() if isinstance(m, Attention)} if modules else set()
    )
    return found or {(int(k.shape[1]), int(k.shape[1]), int(k.shape[2])) for k, _ in kv_caches}


class NpuEngineRunner(DecodeStepRunner):
    """NpuDecodeGraphRunner as the engine's decode step runner (graphs/step_runner.py DecodeStepRunner)."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capture_sizes: list[int],
        max_pages_per_seq: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int32,
        check_device_limits: bool | None = None,
        device_config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """Arguments as the engine passes them; `options` go to NpuDecodeGraphRunner (graph_api, ...).

        check_device_limits (default: on when `device` is an NPU): refuse, before any capture, what the
        Ascend kernels cannot run: _npu_paged_attention's block/head limits and TASK_QUEUE_ENABLE=2. Off
        the NPU the reference ops take any page size, so CPU tests of the runner keep small pages."""
        from backends.npu.attention import check_paged_attention_limits
        from backends.npu.graph_runner import NpuDecodeGraphRunner, check_task_queue_for_capture, task_queue_level

        if check_device_limits if check_device_limits is not None else torch.device(device).type == "npu":
            for heads, kv_heads, head_size in attention_shapes(model, kv_caches):
                check_paged_attention_limits(heads, kv_heads, head_size, page_size)
            runtime = getattr(getattr(torch, "npu", None), "get_task_queue_enable", None)
            check_task_queue_for_capture(task_queue_level(runtime_level=runtime() if callable(runtime) else None))

        # The engine's resolved device config (NpuPlatform.decode_runner_options); a test's runner reads the YAML.
        config = dict(device_config) if device_config is not None else load_yaml_config(NpuPlatform().default_config())
        config.update(
            capture_sizes=capture_sizes,
            max_capture_size=max(capture_sizes),
            page_size=page_size,
            max_model_len=max_pages_per_seq * page_size,
        )
        # NpuAttentionBackend's decode op takes host-side lengths: hand the step the host buffer and
        # refresh the captured op's context_lens before each replay (SGLang's MHA key).
        from backends.npu.attention import SEQ_LENS_UPDATE_KEY

        options.setdefault("pass_host_seq_lens", True)
        if options.get("seq_lens_update_key") is None and not (config.get("npu") or {}).get("seq_lens_update_key"):
            options["seq_lens_update_key"] = SEQ_LENS_UPDATE_KEY
        # Every attention layer launches the op once per step: one graph.update record each, or replays are stale.
        options.setdefault("update_records_per_graph", len(kv_caches))
        # The hooks are the attention backend's (its `graph_hooks`), configured with the runner's settings.
        backend = model.attention_backend
        if backend is not None and backend.graph_hooks is not None:
            options.setdefault("hooks_class", backend.graph_hooks)
        step = model_step(model, kv_caches, page_size)
        self.inner = NpuDecodeGraphRunner.from_config(step, config, num_layers=len(kv_caches), device=device, **options)

    def fits(self, batch_size: int) -> bool:
        return self.inner.fits(batch_size)

    def capture(self) -> None:
        with torch.no_grad():
            self.inner.capture()
        self.report = self.inner.report

    def run_decode(self, message: Any, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step runner's contract (graphs/step_runner.py DecodeStepRunner), through the attention backend's
        hooks (NpuGraphHooks.prepare_for_replay: the message's host tensors, no copy back from the device)."""
        return self.inner.run_decode(message, state)

    def run_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """Logits of one decode batch given as (host or device) tensors."""
        return self.inner.run(input_ids, positions, meta.slot_indices, meta.page_table, meta.seq_lens)
