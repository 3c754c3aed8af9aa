"""The step contract: every way a step runs on a device is a StepRunner.

The engine's ModelRunner holds an ordered list of them, most specialised first, and hands each step to
the first that can run it; the last, EagerStepRunner, runs any step. What a platform contributes is
which runners the list holds (decode graphs per batch size, extend graphs per token count, compiled
layers, its own bucketed prefill), never a new path through the ModelRunner.

Each runner sees the same StepInputs: the step's shape (kind, requests, tokens), its host message,
the persistent decode rows, and the extend batch built on demand (once per step, shared by every runner
that asks). It answers with a StepResult: the logits of the requests that sample, or the hidden states
of every token for the ModelRunner to turn into them (prompt logprobs need every token's).

Two bases for platforms: DecodeStepRunner, the decode contract (fits, run_decode), and DecodeGraphRunner under
it, the platform-independent part of decode graphs (sizes, padding, the shared capture loop) whose subclasses
own only a capture mechanism (CUDA graphs, compiled graphs per size on the CPU, the native CPU step).

A speculative verify step (k+1 tokens per request, logits at each) is StepKind.VERIFY: a decode message
whose rows are each request's last token and its drafts at consecutive positions, sharing the request's
page-table row (engine/step_message.py). Every layer stores all rows' K/V before any row attends, so the
decode kernels give causal attention over the drafts, and every decode runner takes it at the size of its
rows: the decode graphs replay it as captured, and no runner class is needed for it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.capture_sizes import smallest_bucket_at_least
from engine.layers.attention import AttentionMetadata, step_context
from engine.models.interface import CausalLM
from graphs.capture_hooks import CaptureHooks, capture_hooks_for
from graphs.capture_loop import CaptureReport, capture_loop

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch
    from engine.kv_cache import KVPool
    from engine.step_message import DecodeMessage, StepMessage
    from graphs.model_runner import DecodeBatchState


class StepKind(enum.Enum):
    DECODE = "decode"  # one token per request, its rows in the persistent decode state
    EXTEND = "extend"  # prompt chunks (prefill, chunked prefill, prefix-cache continuations)
    MIXED = "mixed"  # decode rows first, then prompt chunks, in one ragged step
    VERIFY = "verify"  # speculative decoding: k+1 tokens per request, every position sampled


ALL_KINDS = frozenset(StepKind)


@dataclass(frozen=True)
class StepShape:
    """What a runner decides on: the step's kind, its requests and its query tokens."""

    kind: StepKind
    num_seqs: int
    num_tokens: int


class StepInputs:
    """One step as every runner sees it; the extend batch is built on first use, once."""

    def __init__(
        self,
        shape: StepShape,
        message: StepMessage,
        state: DecodeBatchState,
        build_batch: Callable[[], ForwardBatch],
    ) -> None:
        self.shape = shape
        self.message = message
        self.state = state
        self._build_batch = build_batch
        self._batch: ForwardBatch | None = None

    @property
    def decode(self) -> DecodeMessage:
        """The decode rows' message (decode and mixed steps)."""
        assert self.message.decode is not None, f"a {self.shape.kind.value} step without decode rows"
        return self.message.decode

    def batch(self) -> ForwardBatch:
        """The step as a ragged ForwardBatch on the device (input ids, positions, attention metadata)."""
        if self._batch is None:
            self._batch = self._build_batch()
        return self._batch


@dataclass
class StepResult:
    """logits: [requests that sample, vocab] float32, when the runner computed them; else hidden: [tokens,
    hidden] of every token (the ModelRunner records prompt logprobs and computes the sampled rows' logits).
    Neither: no request samples (an extend of prompt chunks only). decode_rows: the sampled requests' rows
    of the persistent decode state, on the device (decode steps; None where the message's rows stand)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None


class StepRunner(abc.ABC):
    """Runs the steps it can: captured once before serving (capture), chosen per step (can_run), run (run)."""

    name: ClassVar[str] = "step"
    kinds: ClassVar[frozenset[StepKind]] = ALL_KINDS
    replays_graphs: ClassVar[bool] = False  # whether its steps replay captured or compiled work
    report: CaptureReport | None = None  # what capture() captured (graphs/capture_loop.py)

    def capture(self) -> None:  # noqa: B027 (optional: an eager runner has nothing to capture)
        """Capture, compile or warm up everything it will replay (graphs/capture_loop.py); nothing by default."""

    @property
    def capture_seconds(self) -> float:
        return self.report.seconds if self.report is not None else 0.0

    @property
    def graph_memory_bytes(self) -> int:
        return self.report.memory_bytes if self.report is not None else 0

    @abc.abstractmethod
    def can_run(self, inputs: StepInputs) -> bool:
        """Whether it takes this step; decided from the shape and the message alone (a tensor-parallel rank
        decides without the Request objects, and every rank decides the same)."""

    @abc.abstractmethod
    def run(self, inputs: StepInputs) -> StepResult: ...


class DecodeStepRunner(StepRunner):
    """A runner of pure decode steps up to a batch size (graphs per batch size, on every platform)."""

    name = "decode graphs"
    kinds = frozenset({StepKind.DECODE, StepKind.VERIFY})
    replays_graphs = True

    @abc.abstractmethod
    def fits(self, batch_size: int) -> bool:
        """Whether a decode step of batch_size rows runs here (padded to a captured size)."""

    @abc.abstractmethod
    def run_decode(self, message: DecodeMessage, state: DecodeBatchState) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab] float32, the decode rows [n] on the device) of the message's n rows."""

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.shape.kind in self.kinds and self.fits(inputs.shape.num_seqs)

    def run(self, inputs: StepInputs) -> StepResult:
        logits, rows = self.run_decode(inputs.decode, inputs.state)
        return StepResult(logits=logits, decode_rows=rows)


class EagerStepRunner(StepRunner):
    """The model's forward in plain PyTorch: any step, any shape, nothing captured."""

    name = "eager"

    def __init__(self, model: CausalLM, kv_pool: KVPool) -> None:
        self.model = model
        self.kv_pool = kv_pool

    def can_run(self, inputs: StepInputs) -> bool:
        return True

    def run(self, inputs: StepInputs) -> StepResult:
        batch = inputs.batch()
        with step_context(self.model.attention_backend, batch.meta):
            hidden = self.model(batch.input_ids, batch.positions, self.kv_pool.caches, batch.meta)
        return StepResult(hidden=hidden)


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
