"""Runs one scheduled step: build the batch, run graphs or eager, sample."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.batch_state import DecodeBatchState
from engine.forward_batch import ForwardBatch, extend_forward_batch, mixed_forward_batch
from engine.kv_cache import KVPool
from engine.layers.attention import step_context
from engine.logit_rows import LogitRowLadder
from engine.models.interface import CausalLM
from engine.sampler import SampledTokens, record_prompt_logprobs, sample
from engine.scheduler import ScheduledStep
from engine.step_message import ExtendMessage, StepMessage
from engine.transfer import to_device
from graphs.runner import DecodeRunner, PrefillRunner

if TYPE_CHECKING:
    from graphs.compiled_extend import CompiledExtendStep
    from graphs.extend_graph_runner import ExtendGraphRunner

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 256  # prompt positions per full-vocabulary logits slice (echo + logprobs)


class ModelRunner:
    """Runs a step's message on the device: the decode rows through the platform's graph runner (one
    contract for every platform: `run_decode(message, state)`), prefills through the platform's prefill
    runner where it has one and takes the step (`run_prefill(message)`), everything else eagerly or
    through the compiled/graphed extend step; then samples."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        device: torch.device,
        slot_dtype: torch.dtype,
        graph_runner: DecodeRunner | None,
        decode_state: DecodeBatchState,
        extend_step: CompiledExtendStep | None = None,
        extend_graphs: ExtendGraphRunner | None = None,
        prefill_runner: PrefillRunner | None = None,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.slot_dtype = slot_dtype
        self.graph_runner = graph_runner
        self.decode_state = decode_state
        self.extend_step = extend_step  # compiled prefill/mixed steps; None: eager
        self.extend_graphs = extend_graphs  # their CUDA graphs per token bucket; None: none
        self.prefill_runner = prefill_runner  # the platform's own prefill (HPU prompt buckets); None: none
        self.logit_rows: LogitRowLadder | None = None  # the platform pads the eager LM head's rows (Engine sets it)
        self.graph_steps = 0
        self.eager_steps = 0

    @torch.no_grad()
    def logits(self, step: ScheduledStep, message: StepMessage) -> torch.Tensor | None:
        """Logits [sampled requests, vocab]; None when no request samples (chunks of long prompts only)."""
        return self.forward(step, message)[0]

    def forward(self, step: ScheduledStep, message: StepMessage) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits of the sampled requests, their decode rows on the device: None for extend steps).
        Needs only the step's kind and sample mask, never its Request objects (a tensor-parallel rank > 0
        runs steps that have none: engine/distributed/wire.py)."""
        state = self.decode_state
        if message.decode is not None:
            state.apply(message.decode)
        runner = self.graph_runner
        if step.is_decode:
            assert message.decode is not None
            if runner is not None and runner.can_run(message.decode.batch_size):
                self.graph_steps += 1
                return runner.run_decode(message.decode, state)
            batch = state.decode_batch(message.decode, step.requests)
        elif (
            (prefill := self.prefill_runner) is not None
            and not step.is_mixed
            and message.extend is not None
            and prefill.can_run(message.extend)
        ):
            # Decided from the message alone (no Request objects), as every tensor-parallel rank decides it.
            return prefill.run_prefill(message.extend), None
        else:
            batch = self._extend_batch(step, message)
        if not step.is_decode and self.extend_graphs is not None and self.extend_graphs.can_run(batch):
            hidden = self.extend_graphs.run(batch)
        elif self.extend_step is not None:
            # A decode step too large for the graphs runs the compiled layers without a graph (vLLM's
            # piecewise mode past its capture sizes): the layer graph is token-count dynamic and attention
            # opaque, so it compiles nothing new.
            hidden = self.extend_step(batch.input_ids, batch.positions, batch.meta)
        else:
            self.eager_steps += 1
            with step_context(self.model.attention_backend, batch.meta):
                hidden = self.model(batch.input_ids, batch.positions, self.kv_pool.caches, batch.meta)
        if not step.is_decode:
            assert message.extend is not None
            self._record_prompt_logprobs(hidden, batch, message.extend)
            if not any(step.sample_mask):
                return None, None
            hidden = hidden[batch.logits_indices]
        if self.logit_rows is not None:
            return self.logit_rows.logits(self.model.compute_logits, hidden), batch.decode_rows
        return self.model.compute_logits(hidden), batch.decode_rows

    def _extend_batch(self, step: ScheduledStep, message: StepMessage) -> ForwardBatch:
        """An extend step's batch; a mixed step's decode rows come from the persistent state, first."""
        assert message.extend is not None
        extend = extend_forward_batch(
            message.extend, step.extend_requests, self.kv_pool.page_size, self.device, self.slot_dtype
        )
        if not step.is_mixed:
            return extend
        assert message.decode is not None
        decode = self.decode_state.decode_batch(message.decode, step.decode_requests)
        decode_seq_lens = (message.decode.inputs[1] + 1).tolist()  # host tensor: no device sync
        return mixed_forward_batch(decode, extend, decode_seq_lens)

    def _record_prompt_logprobs(self, hidden: torch.Tensor, batch: ForwardBatch, extend: ExtendMessage) -> None:
        """Echo with logprobs (server): logits of every prompt token, only for requests that ask
        (the message names them). A separate path so that the usual extend still computes logits
        for one row per request.
        """
        starts = batch.meta.query_start_loc
        if starts is None or not extend.prompt_logprob_requests:
            return
        for index in (batch.meta.num_decodes + i for i in extend.prompt_logprob_requests):
            positions = batch.positions[starts[index] : starts[index + 1]].tolist()
            # In slices: full-vocabulary logits for a whole 8k-token chunk would take gigabytes.
            for begin in range(starts[index], starts[index + 1], PROMPT_LOGPROB_ROWS):
                end = min(begin + PROMPT_LOGPROB_ROWS, starts[index + 1])
                offset = begin - starts[index]
                logits = self.model.compute_logits(hidden[begin:end])
                if batch.requests:  # a tensor-parallel rank > 0 has none: it only joins the LM head's collectives
                    record_prompt_logprobs(batch.requests[index], logits, positions[offset : offset + end - begin])

    @torch.no_grad()
    def launch(
        self, step: ScheduledStep, message: StepMessage, before_sampling: Callable[[], None] | None = None
    ) -> SampledTokens | None:
        """Queue the step on the device: forward, sampling, and the sampled tokens kept in the decode
        rows for the next step. Nothing here waits for the device; None when no request samples.
        before_sampling: called once the forward is queued (structured output reads the last step's
        tokens there, while the device runs this forward, so that its masks are up to date)."""
        logits, rows = self.forward(step, message)
        if logits is None:
            return None
        if before_sampling is not None:
            before_sampling()
        state = self.decode_state
        if rows is None or step.is_mixed:
            # An extend: requests that now start decoding got their rows in the message.
            rows = to_device(message.sample_rows, torch.int64, self.device)
        sampled = sample(logits, step.sampled_requests, state.penalties, rows)
        state.record_sampled(rows, sampled.token_ids)
        return sampled
