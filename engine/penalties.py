"""Per-row penalty state on the device (repetition, presence, frequency): filled once per request, updated by
one scatter per step."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.transfer import to_device


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
