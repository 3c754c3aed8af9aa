"""CUDA graphs of prefill, chunk and mixed steps, keyed by token count.

One graph per token bucket (e.g. 16 ... 8192) of the whole forward pass, up to
the hidden states; a step of n tokens replays the smallest bucket >= n. What
makes the attention capturable is that its metadata lives in static buffers
and that nothing about it is decided on the host: the ragged Triton kernel's
grid depends only on the bucket and on the most requests a step can hold
(`max_requests`), and a program finds its request on the device. So the
buffers hold `max_requests + 1` request rows:

- the step's requests (a mixed step's decode rows are one-token requests here);
- one padding request that owns the bucket's tokens past the real ones: its
  k/v go to slot 0 (page 0 is never handed out) and it attends to page 0
  only, so it stays finite and touches no request. Its page-table row is
  as wide as the largest bucket needs (all page 0), and its positions (used
  only by the rotary embedding) cycle within one page, so neither indexes
  past a table however small the model's context is;
- empty requests (no tokens), whose programs return at once.

The LM head runs after the replay on the rows that sample (and prompt
logprobs on the rows that ask), outside the graph. Buckets are captured
largest first into one memory pool (the decode graphs' when given), after two
warm-up runs each, with Python's GC frozen, as the decode graphs are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.capture_sizes import smallest_bucket_at_least
from engine.forward_batch import ForwardBatch
from engine.layers.attention import AttentionMetadata, step_context
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.cuda_graph_runner import WARMUP_RUNS, free_device_memory, frozen_gc
from graphs.step_runner import StepInputs, StepKind, StepResult, StepRunner

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the type torch.cuda.graph_pool_handle() returns

    from engine.models.interface import CausalLM, KVCache

logger = logging.getLogger(__name__)

StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def eager_extend_step(model: CausalLM, kv_caches: list[KVCache]) -> StepFn:
    """The model's eager forward as a StepFn (what an extend graph captures when compile_extend is off)."""

    def step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with step_context(model.attention_backend, meta):
            return model(input_ids, positions, kv_caches, meta)

    return step


class ExtendGraphRunner(StepRunner):
    """Extend and mixed steps of up to max_requests requests and the largest bucket's tokens, replayed."""

    name = "extend graphs"
    kinds = frozenset({StepKind.EXTEND, StepKind.MIXED})
    replays_graphs = True

    def __init__(
        self,
        step_fn: StepFn,
        token_buckets: list[int],
        max_requests: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int64,
        pool: _POOL_HANDLE | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """step_fn(input_ids, positions, meta) -> hidden states [tokens, hidden]: the forward captured.
        pool, stream: the decode graphs' memory pool and capture stream, to capture into (see capture)."""
        self.step_fn = step_fn
        self.pool = pool
        self.stream = stream
        self.buckets = sorted(set(token_buckets))
        self.max_tokens = self.buckets[-1]
        self.max_requests = max_requests
        self.page_size = page_size
        rows = max_requests + 1  # and the padding request
        # Wide enough for the padding request's context (the largest bucket) as well as for any request.
        max_pages = max(max_pages, -(-self.max_tokens // page_size))
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slot_indices = torch.zeros(self.max_tokens, dtype=slot_dtype, device=device)
        self.query_starts = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.pad_positions = torch.arange(self.max_tokens, dtype=torch.int64, device=device) % page_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.input_ids.shape[0] <= self.max_tokens and batch.batch_size <= self.max_requests

    def can_run(self, inputs: StepInputs) -> bool:
        return self.fits(inputs.batch())

    def run(self, inputs: StepInputs) -> StepResult:
        return StepResult(hidden=self.replay(inputs.batch()))

    def _meta(self, tokens: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=False,
            slot_indices=self.slot_indices[:tokens],
            page_table=self.page_table,
            seq_lens=self.seq_lens,
            page_size=self.page_size,
            query_starts=self.query_starts,
        )

    def _fill_dummy(self, tokens: int) -> None:
        """Every token belongs to the padding request (row 0 here), for warm-up and capture."""
        self.input_ids[:tokens].zero_()
        self.positions[:tokens].copy_(self.pad_positions[:tokens])
        self.slot_indices[:tokens].zero_()
        self.query_starts.fill_(tokens)
        self.query_starts[0] = 0
        self.seq_lens.zero_()
        self.seq_lens[0] = tokens
        self.page_table.zero_()

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first, into the pool given (a new one when None) on the stream given.
        Give the decode graphs' pool and capture stream together: the caching allocator reuses a pool's freed
        blocks only for allocations on the stream that freed them, so on a stream of their own the buckets'
        graphs took memory of their own (102-120 MiB for 16-512 tokens on Llama-3-8B)."""
        self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        stream = self.stream = self.stream if self.stream is not None else torch.cuda.Stream()
        self.report = CaptureReport("extend graphs (token counts)")
        with frozen_gc():
            for tokens in capture_loop(self.report, self.buckets, free_memory=free_device_memory):
                self._fill_dummy(tokens)
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_RUNS):
                        self.step_fn(self.input_ids[:tokens], self.positions[:tokens], self._meta(tokens))
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[tokens] = self.step_fn(
                        self.input_ids[:tokens], self.positions[:tokens], self._meta(tokens)
                    )
                self.graphs[tokens] = graph
                torch.cuda.synchronize()

    def fill(self, batch: ForwardBatch, tokens: int) -> None:
        """The batch's n tokens and r requests into the buffers; tokens n..bucket become the padding
        request r (its own positions 0.., slot 0, page 0); requests past it are empty."""
        meta = batch.meta
        assert meta.query_starts is not None, "an extend batch without device query offsets"
        n, r = batch.input_ids.shape[0], batch.batch_size
        width = meta.page_table.shape[1]
        if width > self.page_table.shape[1]:
            raise ValueError(f"page table of {width} pages exceeds the captured {self.page_table.shape[1]}")
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_indices[:n].copy_(meta.slot_indices, non_blocking=True)
        if tokens > n:
            self.input_ids[n:tokens].zero_()
            self.positions[n:tokens].copy_(self.pad_positions[: tokens - n])
            self.slot_indices[n:tokens].zero_()
        self.query_starts[: r + 1].copy_(meta.query_starts, non_blocking=True)
        self.query_starts[r + 1 :].fill_(tokens)
        self.seq_lens[:r].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[r] = tokens - n
        self.seq_lens[r + 1 :].zero_()
        self.page_table[:r, :width].copy_(meta.page_table, non_blocking=True)
        self.page_table[r].zero_()

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [n tokens, hidden] of the batch (a view of the bucket's static output)."""
        n = batch.input_ids.shape[0]
        tokens = smallest_bucket_at_least(self.buckets, n)
        assert tokens is not None, f"{n} tokens exceed the largest extend graph ({self.max_tokens})"
        self.fill(batch, tokens)
        self.graphs[tokens].replay()
        self.replays += 1
        return self.outputs[tokens][:n]
