"""Intel Gaudi (HPU) platform, against habana_frameworks.torch. UNTESTED ON GAUDI HARDWARE.

habana_frameworks is imported lazily, inside methods, so `import backends.hpu`
works on any machine. Capture on Gaudi is shape-bucketed: every decode step is
padded to a (batch_size, num_blocks) bucket (backends/hpu/bucketing.py) and every
bucket is warmed up before serving (backends/hpu/graph_runner.py), in one of two
modes:

- ``compile`` (PT_HPU_LAZY_MODE=0, the eager + torch.compile path): regional
  compilation by default (``hpu.regional_compilation``, as vllm-gaudi's
  VLLM_REGIONAL_COMPILATION): one decoder layer's graph, compiled with
  ``backend="hpu_backend", dynamic=False``, serves every layer, so each bucket costs
  one layer's compile rather than the whole model's; or the whole step compiled at
  once. One compiled entry per bucket either way, so dynamo's recompile limit is
  raised to the bucket count.
- ``lazy`` (PT_HPU_LAZY_MODE=1): the step wrapped with
  ``habana_frameworks.torch.hpu.wrap_in_hpu_graph(module, disable_tensor_cache=True)``,
  one HPU graph recorded per input shape, ``mark_step()`` after each step.

The mode follows ``hpu.graph_mode`` (compile | lazy | eager) of the engine's config
(backends/hpu/settings.py), else what the bridge reports
(``habana_frameworks.torch.utils.internal.is_lazy()``), else PT_HPU_LAZY_MODE.
The same order holds for HpuDecodeRunner.from_config.

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

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from backends.hpu.settings import GRAPH_MODES, HpuSettings
from engine.layers.attention import AttentionMetadata
from engine.platform import (
    CaptureKind,
    CaptureSettings,
    DeviceUnavailableError,
    MemoryInfo,
    Platform,
    load_yaml_config,
)
from engine.transfer import to_device
from graphs.step_runner import DecodeStepRunner

if TYPE_CHECKING:
    from backends.hpu.attention import HpuAttentionBackend
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)


def resolve_graph_mode(
    configured: str | None = None, bridge_lazy: bool | None = None, env: Mapping[str, str] | None = None
) -> str:
    """Pure: `configured` (hpu.graph_mode), else the bridge's mode, else PT_HPU_LAZY_MODE (the bridge's own
    variable, in `env`, default the process's)."""
    env = os.environ if env is None else env
    mode = (configured or "").strip().lower()
    if not mode and bridge_lazy is not None:
        mode = "lazy" if bridge_lazy else "compile"
    if not mode:
        mode = "lazy" if env.get("PT_HPU_LAZY_MODE", "0").strip().lower() in ("1", "true") else "compile"
    if mode not in GRAPH_MODES:
        raise ValueError(f"HPU graph mode must be one of {GRAPH_MODES}, got {mode!r}")
    return mode


def bridge_is_lazy() -> bool | None:
    """What the installed bridge runs in (lazy or eager), or None without habana_frameworks."""
    try:
        from habana_frameworks.torch.utils.internal import is_lazy
    except ImportError:
        return None
    return bool(is_lazy())


class HpuPlatform(Platform):
    """Gaudi 2/3 through the Intel Gaudi PyTorch bridge (habana_frameworks.torch)."""

    name = "hpu"
    device_type = "hpu"
    dist_backend = "hccl"
    slot_index_dtype = torch.int64  # index_copy_ wants int64 indices
    bucketed_steps = True  # every step padded to a bucket (backends/hpu/bucketing.py)

    def __init__(self, graph_mode: str | None = None) -> None:
        self._graph_mode = graph_mode
        self._reason: str | None = None
        self._device_config: dict[str, Any] | None = None  # the engine's (configure), else configs/hpu.yaml
        self._settings: HpuSettings | None = None

    def configure(self, config: EngineConfig) -> None:
        self._device_config = config.device_config
        # Read now: unknown keys and values are refused before anything is built.
        self._settings = HpuSettings.from_device_config(self._device_config)

    @property
    def device_config(self) -> dict[str, Any]:
        """The engine's resolved device config; a platform no engine configured (a test, the tuner) reads its
        own YAML."""
        if self._device_config is None:
            self._device_config = load_yaml_config(self.default_config())
        return self._device_config

    @property
    def settings(self) -> HpuSettings:
        """The hpu: settings of the device config (read once)."""
        if self._settings is None:
            self._settings = HpuSettings.from_device_config(self.device_config)
        return self._settings

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
            self._reason = (
                "habana_frameworks.torch is installed but no Gaudi device is visible (HABANA_VISIBLE_DEVICES?)"
            )
            return False
        self._reason = None
        return True

    def unavailable_reason(self) -> str:
        if self.is_available():
            return "device 'hpu' is available"
        return self._reason or "device 'hpu' is not available on this machine"

    def graph_mode(self) -> str:
        """compile | lazy | eager: constructor argument, hpu.graph_mode, the bridge."""
        if self._graph_mode is not None:
            return resolve_graph_mode(self._graph_mode, env={})
        return resolve_graph_mode(self.settings.graph_mode, bridge_lazy=bridge_is_lazy())

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

    def device_count(self) -> int | None:
        return int(torch.hpu.device_count())

    def set_device(self, index: int) -> None:
        torch.hpu.set_device(index)

    # ---- attention and KV ----------------------------------------------------------
    def attention_backend(self) -> HpuAttentionBackend:
        # Flat paged attention over vllm-gaudi's block list: static shapes per (bs, blocks) bucket. In lazy
        # mode every prefill's forward pass ends with a mark_step (see HpuAttentionBackend.step_context).
        # Padded prompts through FusedSDPA where the bridge has it (hpu.fused_sdpa).
        from backends.hpu.attention import HpuAttentionBackend
        from backends.hpu.fused_sdpa import load_fused_sdpa

        fused_sdpa = load_fused_sdpa(self.settings.fused_sdpa)
        return HpuAttentionBackend(self.store_kv, mark_steps=self.graph_mode() == "lazy", fused_sdpa=fused_sdpa)

    def prepare_model(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        """Decode softmax in fp32 for the model types that need it (hpu.fp32_softmax)."""
        configure_fp32_softmax(model, self.settings.fp32_softmax)

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
                kind=CaptureKind.HPU_GRAPH,
                compile_options={"wrap_in_hpu_graph": True, "disable_tensor_cache": True},
            )
        if mode == "eager":
            return CaptureSettings(kind=CaptureKind.NONE)
        return CaptureSettings(
            kind=CaptureKind.COMPILE,
            compile_backend="hpu_backend",
            compile_options={"dynamic": False, "fullgraph": False, "wrap_in_hpu_graph": False},
        )

    def graph_runner_class(self) -> type:
        # The engine-facing adapter below; HpuDecodeRunner itself takes a step callable.
        return HpuEngineRunner

    def decode_runner_options(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        extend_layer_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, object]:
        """The engine's device config (the runner's buckets and hpu: settings) and graph mode; strict= only with
        --strict-graphs: hpu.strict (on) holds otherwise, in every graph mode."""
        options: dict[str, object] = {"device_config": self.device_config, "mode": self.graph_mode()}
        return {**options, "strict": True} if config.strict_graphs else options

    def prefill_runner_class(self) -> Callable[..., Any]:
        # Extend steps padded to prompt buckets (backends/hpu/prefill_runner.py), so lazy mode compiles one
        # graph per bucket at warm-up rather than one per new prompt length while serving.
        from backends.hpu.prefill_runner import HpuPrefillRunner

        return functools.partial(HpuPrefillRunner.from_engine, device_config=self.device_config, mode=self.graph_mode())

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


def configure_fp32_softmax(model: Any, setting: str | bool = "auto") -> bool:
    """Set fp32_softmax on the model's HPU attention backends from `setting` (hpu.fp32_softmax; "auto": by the
    model's family, FamilyTraits.fp32_softmax_on_hpu)."""
    from backends.hpu.attention import HpuAttentionBackend, fp32_softmax_for
    from engine.layers.attention import Attention

    flag = fp32_softmax_for(model.config.model_type, setting)
    backends = {
        id(b): b for b in [model.attention_backend] + [m.backend for m in model.modules() if isinstance(m, Attention)]
    }
    for backend in backends.values():
        if isinstance(backend, HpuAttentionBackend):
            backend.fp32_softmax = flag
    return flag


def model_step(
    model: Any,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    page_size: int,
    mapping_dtype: torch.dtype = torch.float32,
    decode: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """The decode step over the engine's model, as the runners want it: forward through logits.

    With block metadata (HpuDecodeRunner(with_block_metadata=True) passes block_list,
    block_groups, block_usage as keywords) the flat layout, the one-hot mapping included, is
    built on the device once per step and reaches every layer as meta.platform_metadata.
    `decode(input_ids, positions, meta) -> logits` runs the model (default: eagerly; regional
    compilation passes graphs.compiled_step.CompiledDecodeStep).
    """
    from backends.hpu.attention import HpuFlatMetadata

    def eager(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, kv_caches, meta))

    run = decode if decode is not None else eager

    def step(input_ids, positions, slot_indices, page_table, seq_lens, **block):
        flat = None
        if block:
            flat = HpuFlatMetadata.from_block_metadata(
                page_size=page_size, batch_size=int(input_ids.shape[0]), dtype=mapping_dtype, **block
            )
        meta = AttentionMetadata(
            is_decode=True,
            slot_indices=slot_indices,
            page_table=page_table,
            seq_lens=seq_lens,
            page_size=page_size,
            platform_metadata=flat,
        )
        return run(input_ids, positions, meta)

    return step


class HpuEngineRunner(DecodeStepRunner):
    """HpuDecodeRunner as the engine's decode step runner (graphs/step_runner.py DecodeStepRunner)."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capture_sizes: list[int],
        max_pages_per_seq: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int64,
        strict: bool | None = None,
        regional_compilation: bool | None = None,
        device_config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """Arguments as the engine passes them (HpuPlatform.decode_runner_options adds the engine's
        device_config, its buckets and hpu: settings; None: configs/hpu.yaml); `options` go to HpuDecodeRunner
        (mode, compile_backend, ...). strict None: hpu.strict (on), the same in every graph mode.
        regional_compilation (compile mode; None: hpu.regional_compilation, on): compile one decoder layer's
        graph for all layers instead of the whole step."""
        from backends.hpu.bucketing import resolve_bucket_config
        from backends.hpu.graph_runner import HpuDecodeRunner

        config = dict(device_config) if device_config is not None else load_yaml_config(HpuPlatform().default_config())
        settings = HpuSettings.from_device_config(config)
        config.update(capture_sizes=capture_sizes, page_size=page_size, max_model_len=max_pages_per_seq * page_size)
        options.update(device=device, slot_dtype=slot_dtype)
        # Build vllm-gaudi's flat block layout for every padded bucket: HpuAttentionBackend reads it,
        # and the blocks dimension (not the page-table width) is then what the graphs are keyed on.
        options.setdefault("with_block_metadata", True)
        if strict is not None:
            options["strict"] = strict
        if "mode" not in options:
            options["mode"] = resolve_graph_mode(settings.graph_mode, bridge_lazy=bridge_is_lazy())
        # The attention backend's fp32 softmax is the engine's to set (HpuPlatform.prepare_model), before this.
        self.model, self.kv_caches = model, kv_caches
        decode = None
        if regional_compilation is None:
            regional_compilation = settings.regional_compilation
        pool_pages = kv_caches[0][0].shape[0] // page_size  # no bucket needs more blocks than the pool has
        entries = len(resolve_bucket_config(config).decode_pairs(pool_pages)) + 8  # one compiled entry per bucket
        if options["mode"] == "compile" and regional_compilation:
            from graphs.compiled_step import CompiledDecodeStep

            # dynamic=False: every bucket is an entry of the layer graph; max_entries raises dynamo's limit to that.
            decode = CompiledDecodeStep(
                model,
                kv_caches,
                dynamic=False,
                backend=options.get("compile_backend", "hpu_backend"),
                max_entries=entries,
            )
            options["precompiled"] = True
        self.regional_compilation = decode is not None
        # The hooks are the attention backend's (its `graph_hooks`), configured with the runner's settings.
        backend = model.attention_backend
        if backend is not None and backend.graph_hooks is not None:
            options.setdefault("hooks_class", backend.graph_hooks)
        step = model_step(model, kv_caches, page_size, kv_caches[0][0].dtype, decode)
        self.inner = HpuDecodeRunner.from_config(step, config, pool_pages, **options)
        self.max_batch_size = max(bs for bs, _ in self.inner.buckets)

    def fits(self, batch_size: int) -> bool:
        return 1 <= batch_size <= self.max_batch_size

    def capture(self) -> None:
        with torch.no_grad():
            self.inner.warmup()
        self.report = self.inner.report

    def run_decode(self, message: Any, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step runner's contract (graphs/step_runner.py DecodeStepRunner), through the attention
        backend's hooks (HpuGraphHooks.prepare_for_replay: bucket chosen and batch padded on the host, from the
        message's host tensors, so no step copies its inputs back from the device); a batch past every
        block bucket runs eagerly, as run_batch() does."""
        from backends.hpu.bucketing import BucketOverflowError

        try:
            return self.inner.run_decode(message, state)
        except BucketOverflowError:
            ids, positions, slots, page_table, seq_lens = message.host_batch()
            rows = to_device(message.inputs[3], torch.int64, state.device)
            meta = AttentionMetadata(True, slots, page_table, seq_lens, state.page_size)
            return self.run_batch(ids, positions, meta), rows

    def run_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """Logits of one decode batch given as (host or device) tensors."""
        from backends.hpu.bucketing import BucketOverflowError

        try:
            return self.inner.run(input_ids, positions, meta.slot_indices, meta.page_table, meta.seq_lens)
        except BucketOverflowError as exc:  # more blocks than any bucket: correct but slow, and say so
            logger.warning("decode batch runs eagerly: %s", exc)
            from backends.hpu.attention import HpuFlatMetadata

            # The exact (unbucketed) flat layout, built once for all layers from the inputs as they came
            # (host tensors from run_decode: no copy back), then sent to the device with the rest.
            device = self.kv_caches[0][0].device
            flat = HpuFlatMetadata.from_page_table(
                meta.page_table, meta.seq_lens, meta.page_size, torch.float32, device=device
            )
            input_ids, positions = input_ids.to(device), positions.to(device)
            meta = dataclasses.replace(
                meta,
                slot_indices=meta.slot_indices.to(device),
                page_table=meta.page_table.to(device),
                seq_lens=meta.seq_lens.to(device),
                platform_metadata=flat,
            )
            return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))
