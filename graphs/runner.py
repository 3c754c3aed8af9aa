"""The platform-independent part of a decode graph runner: sizes, padding, slicing."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from engine.capture_sizes import smallest_bucket_at_least
from engine.layers.attention import AttentionMetadata, step_context
from engine.models.interface import CausalLM
from graphs.capture_hooks import CaptureHooks, capture_hooks_for
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.step_runner import DecodeStepRunner

if TYPE_CHECKING:
    from engine.batch_state import DecodeBatchState
    from engine.step_message import DecodeMessage

logger = logging.getLogger(__name__)


class DecodeGraphRunner(DecodeStepRunner):
    """Captures the decode step (forward through logits) per batch size; replays padded batches.

    What the graphs read, and how a step reaches it, belongs to the attention backend's capture hooks
    (graphs/capture_hooks.py); subclasses own only the capture mechanism: what one size's capture is
    (_capture_size), what surrounds the loop (_capturing), and a replay (_replay).
    """

    capture_what = "decode graphs"
    capture_largest_first = True  # into one memory pool: smaller graphs reuse the largest's blocks

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capture_sizes: list[int],
        max_pages_per_seq: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int64,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.capture_sizes = sorted(capture_sizes)
        self.max_batch_size = self.capture_sizes[-1]
        self.device = device
        self.hooks: CaptureHooks = capture_hooks_for(model.attention_backend)
        # The static state every captured size reads (StaticDecodeBuffers with the default hooks).
        self.buffers = self.hooks.init_capture_state(
            self.max_batch_size, max_pages_per_seq, page_size, device, slot_dtype
        )

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    def graph_rows(self, bs: int) -> int:
        """Rows of the static buffers the graph of size bs reads: bs, unless a runner captures that size over
        padding rows too (the CUDA runner's batch 1); the rows past bs are filled as padding before a replay."""
        return bs

    def padded_size(self, batch_size: int) -> int:
        size = smallest_bucket_at_least(self.capture_sizes, batch_size)
        if size is None:
            raise ValueError(f"batch of {batch_size} exceeds the largest captured size {self.max_batch_size}")
        return size

    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture every size through the shared loop (graphs/capture_loop.py); sizes: only these (capture-size
        tuning captures one size a call, to time each and read its memory from the report)."""
        self.report = CaptureReport(self.capture_what)
        with self._capturing():
            for bs in capture_loop(
                self.report,
                self.capture_sizes if sizes is None else sizes,
                largest_first=self.capture_largest_first,
                free_memory=self._free_memory(),
                extra=self._capture_summary,
            ):
                self._capture_size(bs)

    def run_decode(self, message: DecodeMessage, state: DecodeBatchState) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab], decode rows [n]) of the message's rows: the backend's prepare_for_replay
        fills the static state (with the default hooks: straight from the persistent rows with int64
        slots, one copy and a few gathers; otherwise from the rows' device batch)."""
        n = message.batch_size
        padded = self.padded_size(n)
        rows = self.hooks.prepare_for_replay(self.buffers, message, state, self.graph_rows(padded))
        return self._replay(padded)[:n], rows

    def step_eager(self, bs: int) -> torch.Tensor:
        """The step as captured: the model over the static buffers' first bs rows."""
        meta = self.capture_metadata(bs)
        with step_context(self.model.attention_backend, meta):
            hidden = self.model(self.buffers.input_ids[:bs], self.buffers.positions[:bs], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def capture_metadata(self, bs: int) -> AttentionMetadata:
        """The attention metadata the graph of size bs reads (the backend's capture_metadata hook)."""
        return self.hooks.capture_metadata(self.buffers, bs)

    def _capturing(self) -> AbstractContextManager[object]:
        """What surrounds the whole loop (the GC frozen, compile threads, a capture stream); nothing here."""
        return nullcontext()

    def _free_memory(self) -> Callable[[], int] | None:
        """The device's free bytes, where the captures hold device memory (None: the log says nothing)."""
        return None

    def _capture_summary(self) -> str:
        """More for the capture's log line (compiles, warm-up time); nothing here."""
        return ""

    @abc.abstractmethod
    def _capture_size(self, bs: int) -> None: ...

    @abc.abstractmethod
    def _replay(self, bs: int) -> torch.Tensor: ...
