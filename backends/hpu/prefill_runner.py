"""HPU prefill runner: extend steps padded to warmed prompt buckets, run, real rows' logits. UNTESTED ON GAUDI HARDWARE.

Without it an extend step runs the model on its exact token count, with one attention call per request
of that request's length: in lazy mode every new prompt shape is a new graph to compile, seconds each,
while serving. Here (as vllm-gaudi does) the step's prompts are grouped and each group padded on the
host to a prompt bucket (rows, tokens per row) from the HPU bucket config (backends/hpu/prefill.py), or,
where a request has a cached prefix (a prefix-cache hit, a later chunk of a chunked prompt), to a bucket
(rows, tokens per row, context pages per row) whose rows also name the pages that hold their prefix;
the step sees only bucket shapes, attention over the padded batch is one masked op over each row's
prefix pages, gathered on the device, and its new tokens (backends/hpu/prompt_attention.py; FusedSDPA
where the bridge has it, backends/hpu/fused_sdpa.py), padded tokens write only the dummy slot, and the
LM head runs on each row's last token alone. Every bucket runs once at start-up (warm-up), so serving
compiles nothing new. Steps that cannot be bucketed (`prefill.unbucketable_reason`) run the unpadded
path, each reason logged once.

Modes follow the decode runner's (backends/hpu/graph_runner.py): `lazy` runs the step and then
`htorch.core.mark_step()` (the bridge keeps one recipe per bucket shape; prompts are not wrapped in HPU
graphs, whose per-bucket memory vllm-gaudi has to budget separately), `compile` wraps the whole step in
`torch.compile(backend="hpu_backend", dynamic=False)`, one entry per bucket, and `eager` runs it as is.
On CPU (tests) `mode="eager"` or `compile_backend="eager"` run the same code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from backends.hpu.attention import HpuAttentionBackend
from backends.hpu.prefill import (
    PaddedPromptBatch,
    group_prompts,
    pad_prompt_batch,
    prompt_rows,
    unbucketable_reason,
    warmup_prompt_batch,
)
from backends.hpu.prompt_attention import HpuPromptMetadata
from engine.layers.attention import AttentionMetadata
from engine.step_message import ExtendMessage
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.compiled_step import compile_count, compile_limits, private_copy
from graphs.step_runner import StepInputs, StepKind, StepResult, StepRunner

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
PromptStepFn = Callable[..., torch.Tensor]


def prompt_model_step(model: Any, kv_caches: KVCaches, page_size: int, bias_dtype: torch.dtype) -> PromptStepFn:
    """The padded prefill over the engine's model:
    ``step(input_ids [rows*seq], positions [rows*seq], slot_indices [rows*seq], seq_lens [rows], last_index [rows]
    [, ctx_lens [rows], ctx_pages [rows, ctx]]) -> logits [rows, vocab]``, every shape fixed by the bucket (the
    last two for a bucket with context pages). The attention mask is built on the device once per step from
    the lengths (HpuPromptMetadata), not at all for a step without a prefix that FusedSDPA runs with its causal
    flag; and the LM head sees one token per row."""

    def step(
        input_ids,
        positions,
        slot_indices,
        seq_lens,
        last_index,
        ctx_lens=None,
        ctx_pages=None,
    ):
        rows = seq_lens.shape[0]
        # Read per call: follows a backend switched later.
        backend = model.attention_backend
        fused = isinstance(backend, HpuAttentionBackend) and backend.fused_sdpa is not None
        prompt = HpuPromptMetadata.from_lengths(
            seq_lens, input_ids.shape[0] // rows, bias_dtype, ctx_lens, ctx_pages, page_size, with_bias=not fused
        )
        # No page table: a row's prefix pages reach the attention through `prompt.ctx_pages`.
        meta = AttentionMetadata(
            is_decode=False,
            slot_indices=slot_indices,
            page_table=seq_lens.new_zeros((rows, 0)),
            seq_lens=seq_lens,
            page_size=page_size,
            platform_metadata=prompt,
        )
        hidden = model(input_ids, positions, kv_caches, meta)
        return model.compute_logits(hidden.index_select(0, last_index))

    return step


class HpuPrefillRunner(StepRunner):
    """Bucketed prefill on Gaudi: ``capture()`` (warm-up) once, then ``run_prefill(message)`` for each extend
    step that ``fits``; the runners after it in the ModelRunner's list run the others unpadded."""

    name = "HPU prefill buckets"
    kinds = frozenset({StepKind.EXTEND})
    replays_graphs = True

    def __init__(
        self,
        model: Any,
        kv_caches: KVCaches,
        page_size: int,
        device: torch.device | str,
        slot_dtype: torch.dtype = torch.int64,
        *,
        buckets: Sequence[tuple[int, int]],
        ctx_buckets: Sequence[tuple[int, int, int]] = (),
        mode: str = "compile",
        compile_backend: str | Callable[..., Any] = "hpu_backend",
        show_progress: bool = True,
        skip_warmup: bool = False,
    ) -> None:
        if mode not in ("compile", "lazy", "eager"):
            raise ValueError(f"mode must be compile, lazy or eager, got {mode!r}")
        if not buckets:
            raise ValueError("no prompt buckets")
        self.buckets = sorted(set(buckets))
        self.ctx_buckets = sorted(set(ctx_buckets))  # (rows, seq, ctx pages): steps with a cached prefix
        self.page_size = page_size
        self.device = torch.device(device)
        self.slot_dtype = slot_dtype
        self.mode = mode
        self.show_progress = show_progress
        self.skip_warmup = skip_warmup
        self.padded_steps = 0  # forward passes padded to a bucket (a step can take several)
        self.compiles_after_warmup = 0  # dynamo frames compiled by padded steps after warm-up (compile mode)
        self._warm = False
        self._logged: set[str] = set()
        if self.device.type == "hpu":
            import habana_frameworks.torch  # noqa: F401  (registers the hpu device and "hpu_backend")
        step = prompt_model_step(model, kv_caches, page_size, kv_caches[0][0].dtype)
        self._fn = self._build(step, compile_backend)

    @classmethod
    def from_engine(
        cls,
        model: Any,
        kv_caches: KVCaches,
        page_size: int,
        max_model_len: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int64,
        device_config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> HpuPrefillRunner:
        """Buckets, mode and warm-up from the engine's device config (HpuPlatform.prefill_runner_class passes it;
        None: configs/hpu.yaml), for the engine's page size and context length (no bucket longer than the first
        that holds a max_model_len - 1 token prompt; buckets with context pages from hpu.prompt_ctx_bucket,
        within hpu.max_prompt_ctx_buckets)."""
        from backends.hpu.bucketing import resolve_bucket_config
        from backends.hpu.platform import HpuPlatform, bridge_is_lazy, resolve_graph_mode
        from backends.hpu.settings import HpuSettings
        from engine.platform import load_yaml_config

        config = dict(device_config) if device_config is not None else load_yaml_config(HpuPlatform().default_config())
        settings = HpuSettings.from_device_config(config)
        config.update(page_size=page_size, max_model_len=max_model_len)
        if "mode" not in options:
            options["mode"] = resolve_graph_mode(settings.graph_mode, bridge_lazy=bridge_is_lazy())
        options.setdefault("skip_warmup", settings.skip_warmup)
        resolved = resolve_bucket_config(config)
        options.setdefault("ctx_buckets", resolved.prompt_ctx_triples(max_model_len - 1))
        buckets = resolved.prompt_pairs(max_model_len - 1)
        return cls(model, kv_caches, page_size, device, slot_dtype, buckets=buckets, **options)

    def _build(self, step: PromptStepFn, compile_backend: str | Callable[..., Any]) -> PromptStepFn:
        if self.mode != "compile":
            return step  # lazy: the bridge compiles one recipe per bucket shape at mark_step
        # A private code object: another engine's runner in this process keeps its own compiled entries.
        compiled = torch.compile(private_copy(step), backend=compile_backend, dynamic=False)
        entries = len(self.buckets) + len(self.ctx_buckets) + 8  # every bucket is its own compiled entry

        def within_limits(*args: torch.Tensor) -> torch.Tensor:
            with compile_limits(entries):
                return compiled(*args)

        return within_limits

    def _mark_step(self) -> None:
        if self.mode == "lazy":
            import habana_frameworks.torch as htorch

            htorch.core.mark_step()

    def _run(self, batch: PaddedPromptBatch) -> torch.Tensor:
        """One padded forward pass: inputs to the device (one copy each), logits [rows, vocab]."""
        inputs = [tensor.to(self.device, non_blocking=True) for tensor in batch.step_inputs()]
        self._mark_step()  # lazy: the step's graph takes in no work queued before it
        before = compile_count()
        logits = self._fn(*inputs)
        self._mark_step()
        compiled = compile_count() - before
        if compiled and self._warm:
            self.compiles_after_warmup += compiled
            logger.warning("HPU prefill bucket %s compiled %d graph(s) after warm-up", batch.bucket, compiled)
        return logits

    # ---- warm-up ------------------------------------------------------------------------
    def capture(self) -> None:
        """Run every prompt bucket, with context pages or not, before serving (twice when compiled: the second
        run catches guards that fail only on reuse), on batches that write only the dummy slot and read only
        the dummy page. hpu.skip_warmup: buckets compile on first use instead."""
        if self.skip_warmup:
            logger.warning("HPU prefill warm-up skipped: prompt buckets compile on first use")
            self._warm = True
            return
        compiles = compile_count()
        self.report = CaptureReport("HPU prefill buckets (rows, tokens[, context pages])")
        buckets: list[tuple[int, ...]] = [*self.buckets, *self.ctx_buckets]
        with torch.no_grad():
            for bucket in capture_loop(
                self.report,
                buckets,
                progress=self.show_progress,
                extra=lambda: f"mode={self.mode}, {compile_count() - compiles} dynamo compiles",
            ):
                batch = warmup_prompt_batch(bucket, self.slot_dtype, self.page_size)
                for _ in range(2 if self.mode == "compile" else 1):
                    self._run(batch)
                if self.device.type == "hpu":
                    torch.hpu.synchronize()
        self._warm = True

    # ---- serving ------------------------------------------------------------------------
    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.message.extend is not None and self.fits(inputs.message.extend)

    def run(self, inputs: StepInputs) -> StepResult:
        assert inputs.message.extend is not None
        return StepResult(logits=self.run_prefill(inputs.message.extend))

    def fits(self, message: ExtendMessage) -> bool:
        """Whether this extend step can run padded; the first step turned away for each reason is logged."""
        reason = unbucketable_reason(message, self.buckets, self.ctx_buckets, self.page_size)
        if reason is None:
            return True
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("HPU prefill runs unpadded (eager, a new graph per shape) when %s; logged once", reason)
        return False

    def run_prefill(self, message: ExtendMessage) -> torch.Tensor | None:
        """Logits [sampled, vocab] of the message's sampled requests, in its order (its logits_indices);
        None when none samples (chunks of a long prompt). One padded forward pass per group of prompts."""
        rows = prompt_rows(message)
        logits: list[torch.Tensor] = []
        lengths, ctx = [len(r.input_ids) for r in rows], [r.ctx_pages(self.page_size) for r in rows]
        for indices, bucket in group_prompts(lengths, self.buckets, ctx, self.ctx_buckets, self.page_size):
            batch = pad_prompt_batch([rows[i] for i in indices], bucket, self.slot_dtype, self.page_size)
            out = self._run(batch)
            self.padded_steps += 1
            sampled = batch.sampled_rows
            if sampled == list(range(len(sampled))):
                logits.append(out[: len(sampled)])  # the usual case: every prompt samples, a slice
            elif sampled:
                logits.append(out[torch.tensor(sampled, device=out.device)])
        return torch.cat(logits) if len(logits) > 1 else (logits[0] if logits else None)
