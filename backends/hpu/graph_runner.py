"""HPU decode runner: pad to a warmed (batch, blocks) bucket, run, slice. UNTESTED ON GAUDI HARDWARE.

The runner owns no model: it takes a callable
``step(input_ids, positions, slot_indices, page_table, seq_lens) -> logits``
and guarantees that the step only ever sees bucket shapes. Every bucket is run
(twice) during warm-up, so serving never compiles; strict mode turns any compile
after warm-up, or any shape outside the buckets, into an exception instead of a
silent multi-second stall (the recompile storms of HabanaAI/vllm-fork #201).

Compiles are counted inside the decode region only, as vllm-gaudi's track_graph_compile
does (vllm_gaudi/v1/worker/hpu_worker.py: ``metric_localcontext("graph_compilation")``
around the step, ``htorch.hpu.synchronize()`` before leaving it): the bridge's process-wide
``metric_global`` counter also counts prefill, sampler and eager compiles, so reading it made
the first decode after any prefill look like a recompile. In lazy mode a mark_step before the
region flushes whatever was queued outside it (a prefill's tail, the sampler), so that work
compiles outside the region too.

The device-independent parts (bucket choice, padding, the shape check, the
warm-up batch, slicing) are pure functions below and run on CPU in tests; with
``mode="compile", compile_backend="eager", device="cpu"`` the whole runner does too, and a
fake ``habana_frameworks.torch`` (tests) stands in for the bridge's lazy mode and metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from backends.hpu.attention import (  # noqa: F401  (the bucket/block metadata lives with the attention backend)
    STEP_INPUTS,
    HpuGraphHooks,
    move_batch,
    warmup_batch,
)
from backends.hpu.bucketing import PaddedDecodeBatch, page_table_width, resolve_bucket_config
from backends.hpu.settings import HpuSettings
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.compiled_step import compile_count, compile_limits

logger = logging.getLogger(__name__)

StepFn = Callable[..., torch.Tensor]


class ShapeGuaranteeError(RuntimeError):
    """A shape that was not warmed up reached the graph (strict mode)."""


class RecompileAfterWarmupError(RuntimeError):
    """Something compiled after warm-up finished (strict mode)."""


# ---- pure, device-independent helpers -------------------------------------------------------


def expected_shapes(bucket: tuple[int, int], max_blocks_per_seq: int) -> dict[str, tuple[int, ...]]:
    """The exact tensor shapes the step sees for a bucket."""
    bs, blocks = bucket
    shapes: dict[str, tuple[int, ...]] = dict.fromkeys(STEP_INPUTS, (bs,))
    shapes["page_table"] = (bs, page_table_width(blocks, max_blocks_per_seq))
    return shapes


def check_static_shapes(batch: PaddedDecodeBatch, warmed: Collection[tuple[int, int]], max_blocks_per_seq: int) -> None:
    """Raise ShapeGuaranteeError unless the batch is a warmed bucket with that bucket's exact shapes."""
    if batch.bucket not in warmed:
        raise ShapeGuaranteeError(f"bucket {batch.bucket} was not warmed up")
    for name, shape in expected_shapes(batch.bucket, max_blocks_per_seq).items():
        actual = tuple(getattr(batch, name).shape)
        if actual != shape:
            raise ShapeGuaranteeError(f"{name} has shape {actual}, bucket {batch.bucket} expects {shape}")


def slice_logits(logits: torch.Tensor, num_real: int) -> torch.Tensor:
    """Drop the padded rows' outputs."""
    return logits[:num_real]


def bridge_compiles(metric: Any) -> int:
    """Graph compilations a bridge metric object reports: its stats() are (name, value) pairs with
    "TotalNumber" (habana_frameworks.torch.hpu.metrics; vllm-gaudi reads gc.stats()[0][1])."""
    return int(dict(metric.stats()).get("TotalNumber", 0)) if metric is not None else 0


def _bridge_metric_factory() -> Callable[[], AbstractContextManager[Any]]:
    """metric_localcontext("graph_compilation"): counts only what compiles inside its `with` block."""
    from habana_frameworks.torch.hpu.metrics import metric_localcontext

    return lambda: metric_localcontext("graph_compilation")


class _StepModule(torch.nn.Module):
    """wrap_in_hpu_graph wants a module; this one just forwards to the step callable."""

    def __init__(self, step: StepFn) -> None:
        super().__init__()
        self.step = step

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.step(*args, **kwargs)


# ---- the runner ----------------------------------------------------------------------------


class HpuDecodeRunner:
    """Bucketed decode on Gaudi: ``warmup()`` once, then ``run(...)`` per step."""

    def __init__(
        self,
        step: StepFn,
        *,
        buckets: Sequence[tuple[int, int]],
        page_size: int,
        max_blocks_per_seq: int,
        device: torch.device | str = "hpu",
        mode: str = "compile",
        compile_backend: str | Callable[..., Any] = "hpu_backend",
        strict: bool = True,
        with_block_metadata: bool = False,
        slot_dtype: torch.dtype = torch.int64,
        show_progress: bool = True,
        skip_warmup: bool = False,
        precompiled: bool = False,
        compile_metric: Callable[[], AbstractContextManager[Any]] | None = None,
        hooks: HpuGraphHooks | None = None,
        hooks_class: type[HpuGraphHooks] = HpuGraphHooks,
    ) -> None:
        """precompiled: in compile mode the step compiles its own regions (one decoder layer's graph shared
        by every layer, HpuEngineRunner's regional compilation), so the runner does not wrap it whole.
        compile_metric: a factory of the bridge's local compile metric (default on Gaudi:
        metric_localcontext("graph_compilation")); its count inside the decode region trips strict mode.
        hooks: the attention backend's capture/replay hooks (default: hooks_class, the backend's `graph_hooks`,
        over the arguments above,
        backends/hpu/attention.py): warm-up batches, host padding and block metadata; this runner keeps the
        compile-per-bucket mechanism and the strict checks."""
        if mode not in ("compile", "lazy", "eager"):
            raise ValueError(f"mode must be compile, lazy or eager, got {mode!r}")
        if not buckets:
            raise ValueError("no decode buckets")
        self.buckets = sorted(set(buckets))
        self.page_size = page_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        self.mode = mode
        self.strict = strict
        self.with_block_metadata = with_block_metadata
        self.slot_dtype = slot_dtype
        self.show_progress = show_progress
        self.skip_warmup = skip_warmup
        self.precompiled = precompiled
        self.hooks = (
            hooks
            if hooks is not None
            else hooks_class(self.buckets, page_size, max_blocks_per_seq, slot_dtype, with_block_metadata)
        )
        self.replay_state = self.hooks.init_capture_state(
            max(bs for bs, _ in self.buckets), max_blocks_per_seq, page_size, self.device, slot_dtype
        )
        self.warmed: set[tuple[int, int]] = set()
        self.report: CaptureReport | None = None  # of warmup()
        self.dynamo_compiles = 0  # dynamo frames compiled inside this runner's decode regions (warm-up included)
        self.bridge_compiles = 0  # the bridge's graph (recipe) compiles inside them
        self._warm = False
        self._on_hpu = self.device.type == "hpu"
        self._warned_device_inputs = False
        if compile_metric is None and self._on_hpu:
            compile_metric = _bridge_metric_factory()
        self.compile_metric = compile_metric
        self._fn = self._build(step, compile_backend)

    @classmethod
    def from_config(
        cls, step: StepFn, config: Mapping[str, Any], max_blocks_total: int | None = None, **kwargs: Any
    ) -> HpuDecodeRunner:
        """Buckets, mode and strictness from a configs/hpu.yaml-shaped mapping (its hpu: settings,
        backends/hpu/settings.py)."""
        from backends.hpu.platform import bridge_is_lazy, resolve_graph_mode

        settings = HpuSettings.from_device_config(config)
        resolved = resolve_bucket_config(config)
        if "mode" not in kwargs:
            kwargs["mode"] = resolve_graph_mode(settings.graph_mode, bridge_lazy=bridge_is_lazy())
        kwargs.setdefault("strict", settings.strict)
        kwargs.setdefault("skip_warmup", settings.skip_warmup)
        return cls(
            step,
            buckets=resolved.decode_pairs(max_blocks_total),
            page_size=resolved.page_size,
            max_blocks_per_seq=resolved.max_blocks_per_seq,
            **kwargs,
        )

    # ---- capture ------------------------------------------------------------------------
    def _build(self, step: StepFn, compile_backend: str | Callable[..., Any]) -> Callable[..., torch.Tensor]:
        if self._on_hpu:
            import habana_frameworks.torch  # noqa: F401  (registers the hpu device and "hpu_backend")
        if self.mode == "eager":
            return step
        if self.mode == "lazy":
            import habana_frameworks.torch as htorch

            return htorch.hpu.wrap_in_hpu_graph(_StepModule(step), disable_tensor_cache=True)
        if self.precompiled:
            return step  # its regions are compiled (and their entry limits raised) inside it
        compiled = torch.compile(step, backend=compile_backend, dynamic=False)
        entries = len(self.buckets) + 8  # every bucket is its own compiled entry

        def within_limits(*args: Any, **kwargs: Any) -> torch.Tensor:
            with compile_limits(entries):
                return compiled(*args, **kwargs)

        return within_limits

    def shape_key(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """What the step's shapes depend on: (bs, page-table width), or (bs, blocks) with block metadata."""
        return self.hooks.shape_key(bucket)

    def _mark_step(self) -> None:
        if self.mode == "lazy":
            import habana_frameworks.torch as htorch

            htorch.core.mark_step()

    def _call(self, host_batch: PaddedDecodeBatch) -> torch.Tensor:
        """Build any block metadata on the host, copy everything to the device (the hooks), run the step."""
        batch, kwargs = self.hooks.replay_inputs(host_batch, self.device)
        logits = self._fn(
            batch.input_ids, batch.positions, batch.slot_indices, batch.page_table, batch.seq_lens, **kwargs
        )
        self._mark_step()  # lazy mode: flush the accumulated graph now
        return logits

    def _counted_call(self, host_batch: PaddedDecodeBatch) -> tuple[torch.Tensor, int]:
        """Run one step inside the decode region; returns (logits, compiles inside the region).

        Lazy mode first flushes anything queued outside the region (a prefill's tail, the sampler):
        otherwise it would compile at this step's mark_step, inside the region. Dynamo's frame counter
        is read as a difference across the region; the bridge's local metric counts only inside it, and
        the device is synchronized before it closes, so a compile the step triggered is reported here.
        """
        self._mark_step()
        before = compile_count()
        with self.compile_metric() if self.compile_metric is not None else nullcontext() as metric:
            logits = self._call(host_batch)
            if self._on_hpu:
                torch.hpu.synchronize()
        dynamo, bridge = compile_count() - before, bridge_compiles(metric)
        self.dynamo_compiles += dynamo
        self.bridge_compiles += bridge
        return logits, dynamo + bridge

    def warmup(self, skip: bool | None = None) -> float:
        """Run every bucket twice (the second run catches guards that fail only on reuse). Returns seconds.

        hpu.skip_warmup (or skip=True) skips it for development; buckets
        then compile on first use and strict mode stays off.
        """
        if self.skip_warmup if skip is None else skip:
            logger.warning("HPU decode warm-up skipped: buckets compile on first use, strict mode is off")
            return 0.0
        shapes_done: set[tuple[int, int]] = set()
        self.report = CaptureReport("HPU decode buckets (batch size, blocks)")
        for bucket in capture_loop(
            self.report,
            self.buckets,
            progress=self.show_progress,
            extra=lambda: (
                f"{len(shapes_done)} distinct shapes, mode={self.mode}, "
                f"{self.dynamo_compiles} dynamo / {self.bridge_compiles} bridge compiles"
            ),
        ):
            if self.shape_key(bucket) not in shapes_done:  # buckets can share shapes; run each shape once
                batch = self.hooks.capture_inputs(bucket)
                for _ in range(2):
                    self._counted_call(batch)
                shapes_done.add(self.shape_key(bucket))
                if self._on_hpu:
                    torch.hpu.synchronize()
            self.warmed.add(bucket)
        self._warm = True
        return self.report.seconds

    # ---- serving ------------------------------------------------------------------------
    def pad(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_indices: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> PaddedDecodeBatch:
        """Choose the bucket and pad on the host.

        Padding with device ops would compile small recipes for every (n, bucket)
        pair while serving (and trip strict mode); vllm-gaudi builds these on the
        host too. Host inputs (what run_decode passes: the step message's) cost nothing;
        device inputs cost a copy back per step, which is logged once.
        """
        inputs = (input_ids, positions, slot_indices, page_table, seq_lens)
        if not self._warned_device_inputs and any(t.device.type != "cpu" for t in inputs):
            self._warned_device_inputs = True
            logger.warning("HPU decode runner got device inputs: each step copies them back to the host to pad")
        return self.hooks.pad_inputs(*(t.cpu() for t in inputs))

    def run_decode(self, message: Any, batch_state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's decode contract (graphs/step_runner.py DecodeStepRunner): the hooks pick the bucket and pad
        the step message on the host; returns (logits [n, vocab], decode rows)."""
        rows = self.hooks.prepare_for_replay(self.replay_state, message, batch_state, 0)
        batch = self.replay_state.batch
        assert batch is not None
        return self._run_padded(batch), rows

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_indices: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step for n requests given as tensors -> logits [n, vocab]."""
        return self._run_padded(
            self.pad(input_ids, positions, slot_indices, page_table, seq_lens)
        )  # padded on the host

    def _run_padded(self, batch: PaddedDecodeBatch) -> torch.Tensor:
        if not (self.strict and self._warm):
            self._mark_step()  # lazy: the step's graph never takes in work queued before it
            return slice_logits(self._call(batch), batch.num_real)
        check_static_shapes(batch, self.warmed, self.max_blocks_per_seq)
        logits, compiled = self._counted_call(batch)
        if compiled:
            raise RecompileAfterWarmupError(
                f"bucket {batch.bucket} compiled {compiled} graph(s) inside the decode step after warm-up; the step "
                "depends on something besides tensor shapes (a Python scalar, a changing attribute?)"
            )
        return slice_logits(logits, batch.num_real)
