"""The platform-independent part of a decode graph runner: sizes, padding, slicing."""

from __future__ import annotations

import abc
import logging
import time
from typing import TYPE_CHECKING, Protocol

import torch

from engine.capture_sizes import smallest_bucket_at_least
from engine.layers.attention import AttentionMetadata, step_context
from engine.models.interface import CausalLM
from graphs.capture_hooks import CaptureHooks, capture_hooks_for

if TYPE_CHECKING:
    from engine.batch_state import DecodeBatchState
    from engine.step_message import DecodeMessage, ExtendMessage

logger = logging.getLogger(__name__)


class DecodeRunner(Protocol):
    """What every platform's decode runner offers the engine (CUDA/HIP graphs, CPU compiled graphs,
    HPU buckets, NPU graphs): the same decode message from the persistent state, in every case."""

    def can_run(self, batch_size: int) -> bool: ...

    def capture(self) -> None:
        """Capture (or compile and warm up) every size once, before serving."""

    def run_decode(self, message: DecodeMessage, state: DecodeBatchState) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab] float32, the decode rows [n] on the device) of the message's n rows."""
        ...


class PrefillRunner(Protocol):
    """A platform's own prefill (HPU: extend steps padded to warmed prompt buckets). The engine offers it each
    extend step that is not mixed; a step it cannot run goes through the usual extend path."""

    def capture(self) -> None:
        """Compile (warm up) every shape once, before serving."""

    def can_run(self, message: ExtendMessage) -> bool: ...

    def run_prefill(self, message: ExtendMessage) -> torch.Tensor | None:
        """Logits [sampled, vocab] of the message's sampled requests in its order (its logits_indices), after
        every token's k/v is stored; None when no request samples."""
        ...


class DecodeGraphRunner(abc.ABC):
    """Captures the decode step (forward through logits) per batch size; replays padded batches.

    What the graphs read, and how a step reaches it, belongs to the attention backend's capture hooks
    (graphs/capture_hooks.py); subclasses own only the capture mechanism (_capture_all, _replay).
    """

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
        self.hooks: CaptureHooks = capture_hooks_for(getattr(model, "attention_backend", None))
        # The static state every captured size reads (StaticDecodeBuffers with the default hooks).
        self.buffers = self.hooks.init_capture_state(
            self.max_batch_size, max_pages_per_seq, page_size, device, slot_dtype
        )
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    def can_run(self, batch_size: int) -> bool:
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

    def capture(self) -> None:
        """Capture every size, largest first (so smaller graphs reuse the largest's memory pool)."""
        start = time.perf_counter()
        self._capture_all(sorted(self.capture_sizes, reverse=True))
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "%s captured decode sizes %s in %.1f s, graph memory %.1f MiB",
            type(self).__name__,
            self.capture_sizes,
            self.capture_seconds,
            self.graph_memory_bytes / 2**20,
        )

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

    @abc.abstractmethod
    def _capture_all(self, sizes_largest_first: list[int]) -> None: ...

    @abc.abstractmethod
    def _replay(self, bs: int) -> torch.Tensor: ...
