"""HPU decode runner: pad to a warmed (batch, blocks) bucket, run, slice. UNTESTED ON GAUDI HARDWARE.

The runner owns no model: it takes a callable
``step(input_ids, positions, slot_indices, page_table, seq_lens) -> logits``
and guarantees that the step only ever sees bucket shapes. Every bucket is run
(twice) during warm-up, so serving never compiles; strict mode turns any compile
after warm-up, or any shape outside the buckets, into an exception instead of a
silent multi-second stall (the recompile storms of HabanaAI/vllm-fork #201).

The device-independent parts (bucket choice, padding, the shape check, the
warm-up batch, slicing) are pure functions below and run on CPU in tests; with
``mode="compile", compile_backend="eager", device="cpu"`` the whole runner does too.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Collection, Mapping, Sequence

import torch

from backends.hpu.bucketing import (
    PaddedDecodeBatch,
    build_block_metadata,
    choose_decode_bucket,
    pad_decode_batch,
    page_table_width,
    resolve_bucket_config,
)
from graphs.compiled_step import compile_limits

logger = logging.getLogger(__name__)

StepFn = Callable[..., torch.Tensor]
STEP_INPUTS = ("input_ids", "positions", "slot_indices", "page_table", "seq_lens")  # the step's positional args


class ShapeGuaranteeError(RuntimeError):
    """A shape that was not warmed up reached the graph (strict mode)."""


class RecompileAfterWarmupError(RuntimeError):
    """Something compiled after warm-up finished (strict mode)."""


# ---- pure, device-independent helpers -------------------------------------------------------


def expected_shapes(bucket: tuple[int, int], max_blocks_per_seq: int) -> dict[str, tuple[int, ...]]:
    """The exact tensor shapes the step sees for a bucket."""
    bs, blocks = bucket
    shapes: dict[str, tuple[int, ...]] = {name: (bs,) for name in STEP_INPUTS}
    shapes["page_table"] = (bs, page_table_width(blocks, max_blocks_per_seq))
    return shapes


def check_static_shapes(
    batch: PaddedDecodeBatch, warmed: Collection[tuple[int, int]], max_blocks_per_seq: int
) -> None:
    """Raise ShapeGuaranteeError unless the batch is a warmed bucket with that bucket's exact shapes."""
    if batch.bucket not in warmed:
        raise ShapeGuaranteeError(f"bucket {batch.bucket} was not warmed up")
    for name, shape in expected_shapes(batch.bucket, max_blocks_per_seq).items():
        actual = tuple(getattr(batch, name).shape)
        if actual != shape:
            raise ShapeGuaranteeError(f"{name} has shape {actual}, bucket {batch.bucket} expects {shape}")


def warmup_batch(
    bucket: tuple[int, int],
    page_size: int,
    max_blocks_per_seq: int,
    slot_dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
) -> PaddedDecodeBatch:
    """A full batch that lands exactly on `bucket` and only touches the dummy page 0.

    The bucket's blocks are spread over its rows (each >= 1), every page id is 0
    and every slot is 0, so warm-up never writes into a real request's KV.
    """
    bs, blocks = bucket
    base, extra = divmod(blocks, bs)
    pages = torch.full((bs,), base, dtype=torch.int64)
    pages[:extra] += 1
    if int(pages.min()) < 1 or int(pages.max()) > max_blocks_per_seq:
        raise ValueError(f"bucket {bucket} is not valid for max_blocks_per_seq={max_blocks_per_seq}")
    seq_lens = (pages * page_size).to(torch.int32)
    width = page_table_width(blocks, max_blocks_per_seq)
    batch = pad_decode_batch(
        input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=(seq_lens - 1).to(torch.int64),
        slot_indices=torch.zeros(bs, dtype=slot_dtype),
        page_table=torch.zeros(bs, width, dtype=torch.int32),
        seq_lens=seq_lens,
        bucket=bucket,
        page_size=page_size,
        max_blocks_per_seq=max_blocks_per_seq,
    )
    return move_batch(batch, device)


def move_batch(batch: PaddedDecodeBatch, device: torch.device | str) -> PaddedDecodeBatch:
    """One host-to-device copy per tensor; padding happened on the host."""
    moved = {name: getattr(batch, name).to(device, non_blocking=True) for name in STEP_INPUTS}
    return PaddedDecodeBatch(**moved, num_real=batch.num_real, bucket=batch.bucket)


def slice_logits(logits: torch.Tensor, num_real: int) -> torch.Tensor:
    """Drop the padded rows' outputs."""
    return logits[:num_real]


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None or not raw.strip() else raw.strip().lower() in ("1", "true", "yes", "on")


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
        metadata_dtype: torch.dtype = torch.bfloat16,
        slot_dtype: torch.dtype = torch.int64,
        show_progress: bool = True,
        skip_warmup: bool = False,
    ) -> None:
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
        self.metadata_dtype = metadata_dtype
        self.slot_dtype = slot_dtype
        self.show_progress = show_progress
        self.skip_warmup = skip_warmup
        self.warmed: set[tuple[int, int]] = set()
        self.dynamo_compiles = 0
        self._baseline: int | None = None
        self._on_hpu = self.device.type == "hpu"
        self._fn = self._build(step, compile_backend)

    @classmethod
    def from_config(
        cls, step: StepFn, config: Mapping[str, Any], max_blocks_total: int | None = None, **kwargs: Any
    ) -> "HpuDecodeRunner":
        """Buckets, mode and strictness from configs/hpu.yaml plus ENGINE_* env overrides."""
        from backends.hpu.platform import bridge_is_lazy, graph_mode_from_env

        hpu = dict(config.get("hpu") or {})
        resolved = resolve_bucket_config(config)
        if "mode" not in kwargs:
            kwargs["mode"] = graph_mode_from_env(default=hpu.get("graph_mode"), bridge_lazy=bridge_is_lazy())
        kwargs.setdefault("strict", _env_flag("ENGINE_HPU_STRICT", bool(hpu.get("strict", True))))
        kwargs.setdefault("skip_warmup", bool(hpu.get("skip_warmup", False)))
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
        inner = torch._dynamo.lookup_backend(compile_backend) if isinstance(compile_backend, str) else compile_backend

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            # Counted so strict mode can see a compile after warm-up, even on CPU.
            self.dynamo_compiles += 1
            return inner(gm, example_inputs)

        compiled = torch.compile(step, backend=counting_backend, dynamic=False)
        entries = len(self.buckets) + 8  # every bucket is its own compiled entry

        def within_limits(*args: Any, **kwargs: Any) -> torch.Tensor:
            with compile_limits(entries):
                return compiled(*args, **kwargs)

        return within_limits

    def shape_key(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """What the step's shapes depend on: (bs, page-table width), or (bs, blocks) with block metadata."""
        if self.with_block_metadata:
            return bucket
        return bucket[0], page_table_width(bucket[1], self.max_blocks_per_seq)

    def compile_count(self) -> int:
        """Dynamo compiles plus, on Gaudi, graph (recipe) compilations reported by the bridge."""
        count = self.dynamo_compiles
        if self._on_hpu:
            from habana_frameworks.torch.hpu.metrics import metric_global

            count += int(dict(metric_global("graph_compilation").stats())["TotalNumber"])
        return count

    def _call(self, host_batch: PaddedDecodeBatch) -> torch.Tensor:
        """Build any block metadata on the host, copy everything to the device, run the step."""
        kwargs: dict[str, torch.Tensor] = {}
        if self.with_block_metadata:
            meta = build_block_metadata(
                host_batch.page_table, host_batch.seq_lens, self.page_size, host_batch.bucket[1], self.metadata_dtype
            )
            kwargs = {k: v.to(self.device, non_blocking=True) for k, v in vars(meta).items()}
        batch = move_batch(host_batch, self.device)
        logits = self._fn(
            batch.input_ids, batch.positions, batch.slot_indices, batch.page_table, batch.seq_lens, **kwargs
        )
        if self.mode == "lazy":
            import habana_frameworks.torch as htorch

            htorch.core.mark_step()  # lazy mode: flush the accumulated graph now
        return logits

    def warmup(self, skip: bool | None = None) -> float:
        """Run every bucket twice (the second run catches guards that fail only on reuse). Returns seconds.

        ENGINE_HPU_SKIP_WARMUP=1 (or skip=True) skips it for development; buckets
        then compile on first use and strict mode stays off.
        """
        from tqdm import tqdm

        if _env_flag("ENGINE_HPU_SKIP_WARMUP", self.skip_warmup) if skip is None else skip:
            logger.warning("HPU decode warm-up skipped: buckets compile on first use, strict mode is off")
            return 0.0
        start = time.perf_counter()
        shapes_done: set[tuple[int, int]] = set()
        for bucket in tqdm(self.buckets, desc="HPU decode warm-up", disable=not self.show_progress):
            if self.shape_key(bucket) not in shapes_done:  # buckets can share shapes; run each shape once
                batch = warmup_batch(bucket, self.page_size, self.max_blocks_per_seq, self.slot_dtype)
                for _ in range(2):
                    self._call(batch)
                shapes_done.add(self.shape_key(bucket))
            self.warmed.add(bucket)
        if self._on_hpu:
            torch.hpu.synchronize()
        seconds = time.perf_counter() - start
        self._baseline = self.compile_count()
        logger.info(
            "HPU decode warm-up: %d buckets (%d distinct shapes) in %.1f s (mode=%s, %d dynamo compiles)",
            len(self.buckets), len(shapes_done), seconds, self.mode, self.dynamo_compiles,
        )  # fmt: skip
        return seconds

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
        host too. Device inputs cost one copy back here; host inputs cost nothing.
        """
        host = [t.cpu() for t in (input_ids, positions, slot_indices, page_table, seq_lens)]
        bucket = choose_decode_bucket(host[4], self.page_size, self.buckets)
        host[2] = host[2].to(self.slot_dtype)
        return pad_decode_batch(*host, bucket, self.page_size, self.max_blocks_per_seq)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_indices: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step for n requests -> logits [n, vocab]."""
        batch = self.pad(input_ids, positions, slot_indices, page_table, seq_lens)  # on the host
        strict = self.strict and self._baseline is not None
        if strict:
            check_static_shapes(batch, self.warmed, self.max_blocks_per_seq)
        logits = self._call(batch)
        if strict:
            count = self.compile_count()
            if count != self._baseline:
                self._baseline = count  # report once per new compile
                raise RecompileAfterWarmupError(
                    f"bucket {batch.bucket} compiled after warm-up; the step depends on something "
                    "besides tensor shapes (a Python scalar, a changing attribute?)"
                )
        return slice_logits(logits, batch.num_real)

