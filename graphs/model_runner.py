"""Runs one scheduled step: the first step runner that takes it (graphs/step_runner.py), then sampling."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from engine.forward_batch import ForwardBatch, extend_forward_batch, mixed_forward_batch
from engine.kv_cache import KVPool
from engine.layers.attention import AttentionMetadata
from engine.logit_rows import LogitRowLadder
from engine.lora.rows import LoRARows
from engine.models.interface import CausalLM
from engine.penalties import PenaltyState
from engine.request import Request
from engine.sampler import SampledTokens, record_prompt_logprobs, sample
from engine.scheduler import ScheduledStep
from engine.step_message import FIRST_PENDING_DRAFT, DecodeMessage, ExtendMessage, StepMessage
from engine.transfer import to_device
from graphs.step_runner import (
    DecodeStepRunner,
    EagerStepRunner,
    StepInputs,
    StepKind,
    StepRunner,
    StepShape,
)

if TYPE_CHECKING:
    from graphs.compiled_extend import CompiledExtendStep
    from graphs.extend_graph_runner import ExtendGraphRunner

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 256  # prompt positions per full-vocabulary logits slice (echo + logprobs)
R = TypeVar("R", bound=StepRunner)


class DecodeBatchState:
    """Persistent decode state on the device: each decoding request owns a row of a device page table.

    Before this, every decode step rebuilt each request's whole page table (and
    its whole token list) as Python lists and copied them to the device: host
    work that grew with context length. Here (as vLLM's persistent `BlockTable`
    and mini-sglang's device page table) the host side (engine/step_message.py,
    `StepBuilder`) gives a request a row when it first decodes and sends its
    pages once; afterwards a step's message carries only the pages that are new
    (one every `page_size` tokens), which `apply` writes into the device rows.
    The page table rows a step needs are gathered on the device.

    The last sampled token of every row lives on the device too (`last_tokens`):
    with overlap scheduling the next step is launched before the host has seen
    that token, so a request with a token still pending feeds it from there
    (its host token is sent as -1), with no host round trip. A verify step's drafts may still be on the
    device too, in the proposer's buffer (`device_drafts`): their host tokens name their entry there.
    """

    def __init__(
        self, max_rows: int, max_pages: int, page_size: int, device: torch.device, slot_dtype: torch.dtype
    ) -> None:
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=device)
        self.last_tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)  # each row's last sampled token
        self.max_pages = max_pages
        self.page_size = page_size
        self.device = device
        self.slot_dtype = slot_dtype
        self.penalties: PenaltyState | None = None  # set by the engine (needs the vocabulary size)
        # The draft proposer's flat buffer of drafts (speculative decoding with drafts left on the device).
        self.device_drafts: torch.Tensor | None = None

    def apply(self, message: DecodeMessage) -> None:
        """The message's new page-table entries into the device rows (one small copy)."""
        if message.page_diffs is not None:
            diff = to_device(message.page_diffs, torch.int64, self.device)
            self.page_table[diff[0], diff[1]] = diff[2].to(torch.int32)

    def release_row(self, row: int) -> None:
        """A row's request stopped decoding: its penalty state must be refilled for the next owner."""
        if self.penalties is not None:
            self.penalties.release(row)

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """A step's sampled tokens, kept on the device: the next decode step feeds them from here."""
        self.last_tokens.index_copy_(0, rows, token_ids)

    def input_tokens(self, host_tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each row's input token: the host's where it has it, else the row's last sampled token, or for a
        pending draft (engine/step_message.py) its entry of the draft buffer."""
        tokens = torch.where(host_tokens >= 0, host_tokens, self.last_tokens.index_select(0, rows))
        if self.device_drafts is None:
            return tokens
        entries = (FIRST_PENDING_DRAFT - host_tokens).clamp_(min=0)
        return torch.where(host_tokens <= FIRST_PENDING_DRAFT, self.device_drafts.index_select(0, entries), tokens)

    def decode_batch(self, message: DecodeMessage, requests: list[Request]) -> ForwardBatch:
        """The decode rows as a ForwardBatch on the device (eager steps, mixed steps, runners that take one)."""
        inputs = to_device(message.inputs, torch.int64, self.device)
        rows, positions = inputs[3], inputs[1]
        meta = AttentionMetadata(
            is_decode=True,
            slot_indices=inputs[2] if self.slot_dtype == torch.int64 else inputs[2].to(self.slot_dtype),
            page_table=self.page_table.index_select(0, rows),
            seq_lens=(positions + 1).to(torch.int32),
            page_size=self.page_size,
        )
        return ForwardBatch(
            input_ids=self.input_tokens(inputs[0], rows),
            positions=positions,
            meta=meta,
            logits_indices=None,
            requests=requests,
            decode_rows=rows,
        )


class ModelRunner:
    """Runs a step's message on the device through one contract: the step runners, most specialised first
    (the platform's decode graphs, its own prefill, extend graphs, compiled layers), and the eager forward
    last, which takes any step; then samples. Where a runner hands back hidden states, the prompt logprobs
    that were asked for and the logits of the rows that sample are computed here."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        device: torch.device,
        slot_dtype: torch.dtype,
        decode_state: DecodeBatchState,
        step_runners: list[StepRunner],
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.slot_dtype = slot_dtype
        self.decode_state = decode_state
        self.step_runners = [*step_runners, EagerStepRunner(model, kv_pool)]
        # LoRA (engine/lora/): the token -> slot buffer the projections read, set by the engine; None: off.
        self.lora_rows: LoRARows | None = None
        self.received_lora_slots: list[int] | None = None  # a worker's next step's, from rank 0
        self.logit_rows: LogitRowLadder | None = None  # the platform pads the eager LM head's rows (Engine sets it)
        self.steps_run: Counter[str] = Counter()  # steps per runner name

    def runner_of(self, kind: type[R]) -> R | None:
        """The step runner of this class, if the engine has one (benchmarks and tests look inside)."""
        return next((r for r in self.step_runners if isinstance(r, kind)), None)

    @property
    def graph_runner(self) -> DecodeStepRunner | None:
        """The platform's decode-graph runner, if any."""
        return next((r for r in self.step_runners if isinstance(r, DecodeStepRunner)), None)

    @graph_runner.setter
    def graph_runner(self, runner: DecodeStepRunner | None) -> None:
        """Another decode-graph runner (or none) in the first place (capture-size tuning times several)."""
        others = [r for r in self.step_runners if not isinstance(r, DecodeStepRunner)]
        self.step_runners = [runner, *others] if runner is not None else others

    @property
    def extend_graphs(self) -> ExtendGraphRunner | None:
        """The CUDA graphs of extend and mixed steps per token count, if any."""
        from graphs.extend_graph_runner import ExtendGraphRunner

        return self.runner_of(ExtendGraphRunner)

    @property
    def extend_step(self) -> CompiledExtendStep | None:
        """The compiled layers' step (extend, mixed and decode steps past the graphs), if any."""
        from graphs.compiled_extend import CompiledStepRunner

        runner = self.runner_of(CompiledStepRunner)
        return runner.step if runner is not None else None

    @property
    def graph_steps(self) -> int:
        """Decode steps that replayed the decode graphs."""
        return sum(self.steps_run[r.name] for r in self.step_runners if isinstance(r, DecodeStepRunner))

    @property
    def eager_steps(self) -> int:
        return self.steps_run[EagerStepRunner.name]

    def describe(self) -> str:
        """The runners in the order they are offered a step, with what each captured."""
        parts = []
        for runner in self.step_runners:
            report = runner.report
            captured = f" ({len(report.sizes)} sizes, {report.seconds:.1f} s)" if report is not None else ""
            parts.append(f"{runner.name} [{type(runner).__name__}]{captured}")
        return " -> ".join(parts)

    def reset_counts(self) -> None:
        self.steps_run.clear()

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
        inputs = StepInputs(_shape(step, message), message, state, lambda: self._batch(step, message))
        runner = self._first_that_runs(inputs)
        self.steps_run[runner.name] += 1
        if self.lora_rows is not None:
            self._fill_lora_rows(step)
        result = runner.run(inputs)
        if result.hidden is None:
            return result.logits, result.decode_rows
        hidden = result.hidden
        batch = inputs.batch()
        if not step.is_decode:
            assert message.extend is not None
            self._record_prompt_logprobs(hidden, batch, message.extend)
            if not any(step.sample_mask):
                return None, None
            hidden = hidden[batch.logits_indices]
        if self.logit_rows is not None:
            return self.logit_rows.logits(self.model.compute_logits, hidden), batch.decode_rows
        return self.model.compute_logits(hidden), batch.decode_rows

    def lora_token_slots(self, step: ScheduledStep) -> list[int]:
        """Each token's LoRA slot (-1: the base model), in the step's token order. A tensor-parallel worker's
        steps have no requests: rank 0's list arrives with the step (engine/distributed/wire.py) and is
        handed over in `received_lora_slots` for the next forward."""
        if self.received_lora_slots is not None:
            slots, self.received_lora_slots = self.received_lora_slots, None
            return slots
        if step.is_decode:
            return [r.lora_slot for r in step.logit_row_requests]
        slots = [r.lora_slot for r in step.decode_requests]
        return slots + [r.lora_slot for r, n in zip(step.extend_requests, step.extend_lens) for _ in range(n)]

    def _fill_lora_rows(self, step: ScheduledStep) -> None:
        """Each token's LoRA slot into the buffer the projections read (engine/lora/)."""
        assert self.lora_rows is not None
        self.lora_rows.fill(self.lora_token_slots(step))

    def _first_that_runs(self, inputs: StepInputs) -> StepRunner:
        """The first runner that takes the step (the list ends with one that takes every step)."""
        for runner in self.step_runners:
            if inputs.shape.kind in runner.kinds and runner.can_run(inputs):
                return runner
        raise RuntimeError(f"no step runner takes a {inputs.shape}")

    def _batch(self, step: ScheduledStep, message: StepMessage) -> ForwardBatch:
        """The step as one ragged batch on the device, for the runners that take one."""
        if step.is_decode:
            assert message.decode is not None
            return self.decode_state.decode_batch(message.decode, step.logit_row_requests)
        return self._extend_batch(step, message)

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
        sampled = sample(logits, step.logit_row_requests, state.penalties, rows, step.logit_row_drafts)
        if not step.is_verify:  # a verify step's next inputs are on the host (no overlap scheduling with it)
            state.record_sampled(rows, sampled.token_ids)
        return sampled


def _shape(step: ScheduledStep, message: StepMessage) -> StepShape:
    """The step's kind, requests and query tokens, from the message (the same on every tensor-parallel rank)."""
    decodes = message.decode.batch_size if message.decode is not None else 0
    extend = message.extend
    prompts, prompt_tokens = (len(extend.seq_lens), len(extend.input_ids)) if extend is not None else (0, 0)
    if step.is_verify:
        kind = StepKind.VERIFY  # decode rows: each request's last token and its drafts
    elif step.is_decode:
        kind = StepKind.DECODE
    elif decodes:
        kind = StepKind.MIXED
    else:
        kind = StepKind.EXTEND
    return StepShape(kind, decodes + prompts, decodes + prompt_tokens)
