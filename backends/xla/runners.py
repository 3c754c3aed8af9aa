"""The XLA platform's step runners (graphs/step_runner.py's contract): decode programs per batch-size bucket,
prefill programs per token-count bucket. Inputs are padded on the host; XlaPrograms runs them.

Between them they take every decode, verify and extend step (a batch or chunk past the largest bucket runs
as several programs in order), so no step falls through to the eager runner, whose KV cache (the engine's
host pool) the programs never fill. Mixed steps are refused at configuration (backends/xla/platform.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from backends.xla.buckets import bucket_for, split
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.step_runner import DecodeStepRunner, StepInputs, StepKind, StepResult, StepRunner

if TYPE_CHECKING:
    from backends.xla.programs import XlaPrograms
    from engine.step_message import DecodeMessage
    from graphs.model_runner import DecodeBatchState

logger = logging.getLogger(__name__)

# (model, kv_caches, page_size, max_pages) -> the engine's one XlaPrograms (both runners share its KV cache).
ProgramsFor = Callable[[Any, list[tuple[torch.Tensor, torch.Tensor]], int, int], "XlaPrograms"]


def _pad(tensor: torch.Tensor, size: int, value: int = 0) -> torch.Tensor:
    """Rows past the tensor's own up to `size` (dim 0), filled with `value`."""
    pad = size - tensor.shape[0]
    if pad == 0:
        return tensor
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, pad), value=value)


def _compile_summary(programs: XlaPrograms, before: int) -> Callable[[], str]:
    return lambda: f"{programs.counter.count - before} XLA compiles, jit caches {programs.cache_sizes()}"


class XlaDecodeRunner(DecodeStepRunner):
    """Decode (and verify) steps: the batch padded to a batch-size bucket (capture_sizes), one program each.
    Padding rows read and write slot 0 of the pool's reserved page 0."""

    name = "xla decode programs"

    def __init__(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capture_sizes: list[int],
        max_pages_per_seq: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int64,
        *,
        programs_for: ProgramsFor,
    ) -> None:
        self.programs = programs_for(model, kv_caches, page_size, max_pages_per_seq)
        self.sizes = sorted(set(capture_sizes))
        self.max_pages = max_pages_per_seq

    def fits(self, batch_size: int) -> bool:
        return batch_size >= 1  # past the largest bucket: in pieces

    def capture(self) -> None:
        """Compile every bucket's program by running it once on padding (smallest first: no pool to share)."""
        self.report = CaptureReport("XLA decode programs")
        summary = _compile_summary(self.programs, self.programs.counter.count)
        for bs in capture_loop(self.report, self.sizes, largest_first=False, extra=summary):
            seconds, compiles = self.programs.timed(functools.partial(self._warm, bs))
            logger.info("XLA: decode program for batch %d: %d compile(s), %.1f s", bs, compiles, seconds)

    def _warm(self, bs: int) -> torch.Tensor:
        """One run of batch bs's program on padding rows only (token 0 at position 0, into the reserved slot 0)."""
        empty = torch.zeros(bs, dtype=torch.int64)
        return self._padded(empty, empty, empty, torch.zeros(bs, self.max_pages, dtype=torch.int32), empty + 1)

    def run_decode(self, message: DecodeMessage, state: DecodeBatchState) -> tuple[torch.Tensor, torch.Tensor]:
        batch = state.decode_batch(message, [])  # host tensors: the engine's device is the host here
        meta = batch.meta
        assert batch.decode_rows is not None
        pieces = [
            self._padded(
                batch.input_ids[a:b],
                batch.positions[a:b],
                meta.slot_indices[a:b],
                meta.page_table[a:b],
                meta.seq_lens[a:b],
            )
            for a, b in split(batch.input_ids.shape[0], self.sizes[-1])
        ]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0], batch.decode_rows

    def _padded(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        size = bucket_for(self.sizes, n)
        table = F.pad(page_table, (0, self.max_pages - page_table.shape[1]))
        logits = self.programs.decode(
            _pad(input_ids, size),
            _pad(positions, size),
            _pad(slots, size),
            _pad(table, size),
            _pad(seq_lens, size, value=1),  # a padding row attends to its one (reserved) slot
        )
        return logits[:n]


class XlaPrefillRunner(StepRunner):
    """Extend steps: each request's chunk padded to a token-count bucket (extend_capture_tokens), one program
    each; the hidden states go back to the ModelRunner (LM head of the sampled rows, prompt logprobs)."""

    name = "xla prefill programs"
    kinds: ClassVar[frozenset[StepKind]] = frozenset({StepKind.EXTEND})
    replays_graphs = True

    def __init__(self, programs: XlaPrograms, buckets: list[int]) -> None:
        self.programs = programs
        self.buckets = sorted(set(buckets))

    @classmethod
    def from_engine(
        cls,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        max_model_len: int,
        device: torch.device,
        slot_dtype: torch.dtype,
        *,
        programs_for: ProgramsFor,
        buckets: list[int],
    ) -> XlaPrefillRunner:
        """The engine's prefill-runner factory call (Platform.prefill_runner_class)."""
        max_pages = -(-max_model_len // page_size)
        return cls(programs_for(model, kv_caches, page_size, max_pages), buckets)

    def capture(self) -> None:
        self.report = CaptureReport("XLA prefill programs")
        summary = _compile_summary(self.programs, self.programs.counter.count)
        for tokens in capture_loop(self.report, self.buckets, largest_first=False, extra=summary):
            seconds, compiles = self.programs.timed(functools.partial(self._warm, tokens))
            logger.info("XLA: prefill program for %d tokens: %d compile(s), %.1f s", tokens, compiles, seconds)

    def _warm(self, tokens: int) -> torch.Tensor:
        """One run of the bucket's program on padding tokens only (position 0, into the reserved slot 0)."""
        empty = torch.zeros(tokens, dtype=torch.int64)
        return self.programs.prefill(empty, empty, empty, torch.zeros(self.programs.max_pages, dtype=torch.int32))

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.shape.kind is StepKind.EXTEND

    def run(self, inputs: StepInputs) -> StepResult:
        extend = inputs.message.extend
        assert extend is not None
        ids = torch.tensor(extend.input_ids, dtype=torch.int64)
        positions = torch.tensor(extend.positions, dtype=torch.int64)
        slots = torch.tensor(extend.slots, dtype=torch.int64)
        pieces = []
        for index, row in enumerate(extend.page_rows):
            start, end = extend.query_start_loc[index], extend.query_start_loc[index + 1]
            pages = F.pad(torch.tensor(row, dtype=torch.int32), (0, self.programs.max_pages - len(row)))
            for a, b in split(end - start, self.buckets[-1]):
                lo, hi = start + a, start + b
                size = bucket_for(self.buckets, hi - lo)
                hidden = self.programs.prefill(
                    _pad(ids[lo:hi], size), _pad(positions[lo:hi], size), _pad(slots[lo:hi], size), pages
                )
                pieces.append(hidden[: hi - lo])
        return StepResult(hidden=torch.cat(pieces) if len(pieces) > 1 else pieces[0])
