"""Persistent decode state: each running request owns a row of a device page table, updated by diffs.

Before this, every decode step rebuilt each request's whole page table (and
its whole token list) as Python lists and copied them to the device: host
work that grew with context length. Here (as vLLM's persistent `BlockTable`
and mini-sglang's device page table) a request gets a row when it first
decodes and its pages are written once; afterwards a step writes only the
pages that are new (one every `page_size` tokens). The per-step host work is
O(batch): for each request its row, last token, position and slot, packed
into one host tensor and sent in one copy. The page table rows the step needs
are gathered on the device.

The last sampled token of every row lives on the device too (`last_tokens`):
with overlap scheduling the next step is launched before the host has seen
that token, so a request with a token still pending feeds it from there
(its host token is sent as -1), with no host round trip.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.forward_batch import ForwardBatch
from engine.layers.attention import AttentionMetadata
from engine.request import Request
from engine.transfer import host_tensor, to_device

PENDING_TOKEN = -1  # host_inputs' token for a request whose last token is still on the device


class DecodeBatchState:
    def __init__(
        self,
        max_rows: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype,
        pages_of: Callable[[Request], tuple[list[int], list[int]]],
        mirror_on_host: bool | None = None,
    ) -> None:
        """pages_of(request) -> (shared prefix pages, private pages): the request's table in two parts.
        mirror_on_host: keep a host copy of the rows (default: when the device is not the CPU)."""
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=device)
        # The same rows on the host, for runners that pad batches on the host (HPU buckets): written
        # with the same diffs, so such a runner never copies the device table back.
        if mirror_on_host is None:
            mirror_on_host = device.type != "cpu"
        self.host_page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32) if mirror_on_host else self.page_table
        self.last_tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)  # each row's last sampled token
        self.max_pages = max_pages
        self.page_size = page_size
        self.device = device
        self.slot_dtype = slot_dtype
        self.pages_of = pages_of
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.penalties: PenaltyState | None = None  # set by the engine (needs the vocabulary size)
        self.rows_written = 0  # page-table entries sent to the device so far (a test reads it)

    @property
    def rows_in_use(self) -> int:
        return self.page_table.shape[0] - len(self._free_rows)

    def release(self, request: Request) -> None:
        """The request stopped decoding (finished, aborted or retracted): its row is free again."""
        if request.batch_row is not None:
            if self.penalties is not None:
                self.penalties.release(request.batch_row)
            self._free_rows.append(request.batch_row)
            request.batch_row = None
            request.batch_row_pages = 0

    def assign_row(self, request: Request) -> int:
        """The request's decode row, taken from the free rows the first time it samples."""
        if request.batch_row is None:
            request.batch_row = self._free_rows.pop()
            request.batch_row_pages = 0
        return request.batch_row

    def rows_of(self, requests: list[Request]) -> torch.Tensor:
        """The decode rows of these requests (assigned where new), on the device."""
        return to_device([self.assign_row(r) for r in requests], torch.int64, self.device)

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """A step's sampled tokens, kept on the device: the next decode step feeds them from here."""
        self.last_tokens.index_copy_(0, rows, token_ids)

    def input_tokens(self, host_tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each request's input token: the host's where it has it, else the row's last sampled token."""
        return torch.where(host_tokens >= 0, host_tokens, self.last_tokens.index_select(0, rows))

    def host_inputs(self, requests: list[Request]) -> torch.Tensor:
        """[4, batch] int64 on the host (pinned for CUDA): (input token or PENDING_TOKEN, position,
        KV slot, decode row) of each request.

        O(batch): a request's pages are written to its device row once, then only new ones
        (one every page_size tokens); the diffs go to the device here, in one small copy.
        """
        diff_rows: list[int] = []
        diff_cols: list[int] = []
        diff_pages: list[int] = []
        # Plain Python lists, turned into one tensor at the end (element writes into a tensor cost ~1 us each).
        row_list, token_list, position_list, slot_list = [], [], [], []
        page_size = self.page_size
        for request in requests:
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
                request.batch_row_pages = num_pages
            position = request.num_tokens_with_pending - 1
            column = position // page_size
            page = shared[column] if column < len(shared) else private[column - len(shared)]
            row_list.append(row)
            token_list.append(PENDING_TOKEN if request.num_pending_tokens else request.last_token_id)
            position_list.append(position)
            slot_list.append(page * page_size + position % page_size)
        if diff_rows:
            self.rows_written += len(diff_rows)
            diff = to_device([diff_rows, diff_cols, diff_pages], torch.int64, self.device)
            self.page_table[diff[0], diff[1]] = diff[2].to(torch.int32)
            if self.host_page_table is not self.page_table:
                self.host_page_table[diff_rows, diff_cols] = torch.tensor(diff_pages, dtype=torch.int32)
        return host_tensor([token_list, position_list, slot_list, row_list], torch.int64, self.device)

    def decode_batch(self, requests: list[Request], on_host: bool = False) -> ForwardBatch:
        """The decode step as a ForwardBatch (eager steps, and graph runners that take one).

        on_host: inputs and page table as host tensors (decode rows still on the device, for the
        sampler), for runners that pad on the host; every input token must be known to the host then
        (no overlap scheduling)."""
        host = self.host_inputs(requests)
        if on_host:
            if bool((host[0] == PENDING_TOKEN).any()):
                raise ValueError("a host-side decode batch needs every input token on the host (overlap scheduling is on)")
            inputs, table, rows = host, self.host_page_table, to_device(host[3], torch.int64, self.device)
            input_ids = host[0]
        else:
            inputs, table = to_device(host, torch.int64, self.device), self.page_table
            rows = inputs[3]
            input_ids = self.input_tokens(inputs[0], rows)
        positions = inputs[1]
        meta = AttentionMetadata(
            is_decode=True,
            slot_indices=inputs[2] if self.slot_dtype == torch.int64 else inputs[2].to(self.slot_dtype),
            page_table=table.index_select(0, inputs[3]),
            seq_lens=(positions + 1).to(torch.int32),
            page_size=self.page_size,
        )
        return ForwardBatch(input_ids=input_ids, positions=positions, meta=meta, logits_indices=None, requests=requests,
                            decode_rows=rows)


class PenaltyState:
    """Per decode row: which tokens the request has seen (prompt + output) and how often it produced each.

    Repetition, presence and frequency penalties used to rebuild these from the
    token lists in Python for every row at every step (O(context)). Here a row
    is filled once when its request starts decoding, and each step adds the
    sampled tokens with one scatter. Allocated on the first penalized request.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.seen: torch.Tensor | None = None  # [rows, vocab] bool
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32, output tokens only (OpenAI's semantics)
        self.ready: set[int] = set()  # rows filled for their current request

    def _allocate(self) -> None:
        if self.seen is None:
            self.seen = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)

    def release(self, row: int) -> None:
        self.ready.discard(row)

    def fill_new_rows(self, requests: list[Request]) -> None:
        """Fill the rows of these (penalized) requests where a row is new to its request."""
        self._allocate()
        assert self.seen is not None and self.counts is not None
        for request in requests:
            row = request.batch_row
            assert row is not None, "penalty rows exist for requests with a decode row only"
            if row not in self.ready:
                # O(context) once per request, when it first samples (and again after a retraction).
                # Every token is on the host then: a request is prefilled only with nothing pending.
                self.seen[row].zero_()
                self.seen[row].index_fill_(0, to_device(request.all_token_ids, torch.int64, self.device), True)
                self.counts[row].zero_()
                if request.output_token_ids:
                    out = to_device(request.output_token_ids, torch.int64, self.device)
                    self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
                self.ready.add(row)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """This step's sampled tokens of those rows (device tensors, no host round trip)."""
        assert self.seen is not None and self.counts is not None
        # Flat indices and in-place fills/adds: `seen[rows, tokens] = True` copies the scalar to the
        # device with a blocking copy, a host sync per step.
        flat = rows * self.vocab_size + tokens
        self.seen.view(-1).index_fill_(0, flat, True)
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
