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
(its host token is sent as -1), with no host round trip.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.layers.attention import AttentionMetadata
from engine.request import Request
from engine.step_message import DecodeMessage
from engine.transfer import to_device


class DecodeBatchState:
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
        """Each request's input token: the host's where it has it, else the row's last sampled token."""
        return torch.where(host_tokens >= 0, host_tokens, self.last_tokens.index_select(0, rows))

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
