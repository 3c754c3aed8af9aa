"""The step description: what the host tells the device side about one scheduled step.

The scheduler decides which requests run and how many tokens each; the
`StepBuilder` turns that `ScheduledStep` into a `StepMessage` of host data
only: for decode rows, one [4, n] int64 tensor (input token or PENDING_TOKEN,
position, KV slot, decode row) and the page-table entries that are new since
the rows were last sent; for prefill chunks, flat host lists (tokens,
positions, slots, the ragged offsets, page rows). Building it is O(batch) for
decode rows: a request gets a decode row when it first samples, its pages
are sent once, and afterwards only a new page every `page_size` tokens.

The model runner applies a message to the device state (`DecodeBatchState` in graphs/model_runner.py:
the device page table takes the diffs) and runs it, and every platform's graph
runner takes the same decode message (graphs/step_runner.py `run_decode`). This is
the message tensor parallelism sends from rank 0 to the other ranks
(engine/distributed/wire.py): it holds no Request objects and nothing that
grows with a request's context per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.request import Request
from engine.scheduler import ScheduledStep
from engine.transfer import host_tensor

PENDING_TOKEN = -1  # a decode row's input token still on the device (overlap scheduling)
# A verify step's draft still on the device, as the proposer left it: FIRST_PENDING_DRAFT - i stands for entry i
# of the draft buffer (DecodeBatchState.device_drafts). The host builds the verify step while the device drafts,
# and reads the values back with the step's sampled tokens.
FIRST_PENDING_DRAFT = -2


def pending_draft(index: int) -> int:
    """The input token that stands for entry `index` of the device's draft buffer."""
    return FIRST_PENDING_DRAFT - index


@dataclass
class DecodeMessage:
    """The decode rows of a step."""

    # [4, n] int64 on the host (pinned for CUDA): token (or PENDING_TOKEN, or a pending draft), position, slot, row
    inputs: torch.Tensor
    page_diffs: torch.Tensor | None  # [3, m] int64 on the host: (row, column, page) written since the last step
    # This process's host copy of every row's pages (kept from the same diffs): for runners that pad
    # on the host (HPU buckets, NPU host lengths). A receiving rank keeps its own from page_diffs.
    host_page_table: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.inputs.shape[1]

    @property
    def has_pending_tokens(self) -> bool:
        return bool((self.inputs[0] < 0).any())  # PENDING_TOKEN or a pending draft

    def host_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids, positions, slots, page-table rows, seq lens) as host tensors, for runners that
        pad on the host; every input token must be on the host (no overlap scheduling there)."""
        if self.has_pending_tokens:
            raise ValueError("a host-side decode batch needs every input token on the host (overlap scheduling is on)")
        tokens, positions, slots, rows = self.inputs
        return tokens, positions, slots, self.host_page_table.index_select(0, rows), (positions + 1).to(torch.int32)


@dataclass
class ExtendMessage:
    """The prefill chunks of a step (a mixed step's second part), as flat host lists."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]  # per request: context length after this step
    query_start_loc: list[int]  # [requests + 1] offsets into the tokens
    page_rows: list[list[int]]  # per request, 0-padded to the widest
    logits_indices: list[int]  # token rows whose logits are sampled
    # Requests (indices among these) whose prompt tokens' logprobs are asked for (echo): the runner computes
    # the LM head over their whole chunk, which every tensor-parallel rank must join.
    prompt_logprob_requests: list[int] = field(default_factory=list)


@dataclass
class StepMessage:
    decode: DecodeMessage | None  # the decode rows (a pure decode step, or a mixed step's first part)
    extend: ExtendMessage | None  # the prefill chunks
    # Extend and mixed steps: the decode row of each sampled request, in step order (sampling and penalty
    # state). Empty for decode steps, whose runner returns the rows it read from `decode`.
    sample_rows: list[int]


def slot_of(pages: list[int], position: int, page_size: int) -> int:
    return pages[position // page_size] * page_size + position % page_size


def extend_message(
    requests: list[Request],
    pages_of: dict[str, list[int]],
    page_size: int,
    extend_lens: list[int] | None = None,
    sample_mask: list[bool] | None = None,
) -> ExtendMessage:
    """Request i runs extend_lens[i] tokens from its first uncached one (a chunk, or all of them);
    only requests in sample_mask get a row in logits_indices."""
    message = ExtendMessage([], [], [], [], [0], [], [])
    width = max(len(pages_of[r.request_id]) for r in requests)
    for index, request in enumerate(requests):
        pages = pages_of[request.request_id]
        tokens = request.all_token_ids
        start = request.num_cached_tokens
        end = start + extend_lens[index] if extend_lens is not None else request.num_tokens
        message.input_ids.extend(tokens[start:end])
        message.positions.extend(range(start, end))
        message.slots.extend(slot_of(pages, position, page_size) for position in range(start, end))
        message.seq_lens.append(end)
        message.query_start_loc.append(len(message.input_ids))
        if sample_mask is None or sample_mask[index]:
            message.logits_indices.append(len(message.input_ids) - 1)
        if request.params.prompt_logprobs is not None:
            message.prompt_logprob_requests.append(index)
        message.page_rows.append(pages + [0] * (width - len(pages)))
    return message


class StepBuilder:
    """Host side of the persistent decode state: which row each decoding request owns, which of its
    pages the device rows hold; builds each step's message."""

    def __init__(
        self,
        max_rows: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        pages_of: Callable[[Request], tuple[list[int], list[int]]],
        on_row_released: Callable[[int], None] = lambda row: None,
    ) -> None:
        """pages_of(request) -> (shared prefix pages, private pages): the request's table in two parts.
        device: where the message goes (its host tensors are pinned for CUDA)."""
        self.max_pages = max_pages
        self.page_size = page_size
        self.device = device
        self.pages_of = pages_of
        self.on_row_released = on_row_released
        self.host_page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.rows_written = 0  # page-table entries sent so far (a test reads it)

    @property
    def rows_in_use(self) -> int:
        return self.host_page_table.shape[0] - len(self._free_rows)

    def assign_row(self, request: Request) -> int:
        """The request's decode row, taken from the free rows the first time it samples."""
        if request.batch_row is None:
            request.batch_row = self._free_rows.pop()
            request.batch_row_pages = 0
        return request.batch_row

    def release(self, request: Request) -> None:
        """The request stopped decoding (finished, aborted or retracted): its row is free again."""
        if request.batch_row is not None:
            self.on_row_released(request.batch_row)
            self._free_rows.append(request.batch_row)
            request.batch_row = None
            request.batch_row_pages = 0

    def build(self, step: ScheduledStep) -> StepMessage:
        decode = self.decode_message(step.decode_requests, step.drafts) if step.num_decodes else None
        if step.is_decode:
            # Every row samples and the runner hands back the rows it read: nothing more per step.
            return StepMessage(decode, None, [])
        requests = step.extend_requests
        pages = {r.request_id: shared + private for r in requests for shared, private in [self.pages_of(r)]}
        extend = extend_message(requests, pages, self.page_size, step.extend_lens, step.sample_mask[step.num_decodes :])
        # A mixed step's decode rows were assigned by decode_message; requests that now start decoding get theirs.
        sample_rows = [self.assign_row(r) for r in step.sampled_requests]
        return StepMessage(decode, extend, sample_rows)

    def decode_message(self, requests: list[Request], drafts: list[list[int]] | None = None) -> DecodeMessage:
        """O(batch): each row's input token, position, slot and row, and the pages new since last time.

        drafts (a verify step): request i also runs drafts[i], each a row of its own at the next position,
        reading the request's page-table row. Every layer stores all rows' K/V before any row attends, so a
        row sees the drafts before it and not those after: causal attention over the drafts, with the decode
        kernels and graphs as they are (a step of 1 + k rows per request)."""
        diff_rows: list[int] = []
        diff_cols: list[int] = []
        diff_pages: list[int] = []
        # Plain Python lists, turned into one tensor at the end (element writes into a tensor cost ~1 us each).
        row_list, token_list, position_list, slot_list = [], [], [], []
        sent: list[tuple[Request, int]] = []  # rows' new page counts, recorded once the whole message is built
        page_size = self.page_size
        for index, request in enumerate(requests):
            shared, private = self.pages_of(request)
            num_pages = len(shared) + len(private)
            row = self.assign_row(request)
            written = request.batch_row_pages
            if num_pages > written:
                if num_pages > self.max_pages:
                    raise ValueError(f"request {request.request_id} has {num_pages} pages; rows hold {self.max_pages}")
                for column in range(written, num_pages):
                    diff_rows.append(row)
                    diff_cols.append(column)
                    diff_pages.append(shared[column] if column < len(shared) else private[column - len(shared)])
                sent.append((request, num_pages))
            position = request.num_tokens_with_pending - 1
            column = position // page_size
            page = shared[column] if column < len(shared) else private[column - len(shared)]
            row_list.append(row)
            token_list.append(PENDING_TOKEN if request.num_pending_tokens else request.last_token_id)
            position_list.append(position)
            slot_list.append(page * page_size + position % page_size)
            for offset, token in enumerate(drafts[index] if drafts is not None else (), start=1):
                column = (position + offset) // page_size  # a draft's row: the next position, the same page row
                page = shared[column] if column < len(shared) else private[column - len(shared)]
                row_list.append(row)
                token_list.append(token)
                position_list.append(position + offset)
                slot_list.append(page * page_size + (position + offset) % page_size)
        for request, num_pages in sent:
            request.batch_row_pages = num_pages
        diffs = None
        if diff_rows:
            self.rows_written += len(diff_rows)
            self.host_page_table[diff_rows, diff_cols] = torch.tensor(diff_pages, dtype=torch.int32)
            diffs = host_tensor([diff_rows, diff_cols, diff_pages], torch.int64, self.device)
        inputs = host_tensor([token_list, position_list, slot_list, row_list], torch.int64, self.device)
        return DecodeMessage(inputs, diffs, self.host_page_table)
