"""The step's token -> adapter slot map on the device, shared by every LoRA projection of the model.

Filled by the model runner before each step from the host's list of slots (-1: the base model); the rows a
graph pads with stay -1. For kernels that work slot by slot (CUDA's grouped Triton kernels) it also holds the
rows grouped by slot, which the host computes with the list it has anyway, so the device never sorts and the
host never waits for the device:

- `sorted_rows` [max_tokens]: slot 0's rows, slot 1's, ..., then the base model's rows and every row after the
  step's (a graph's padding), in order;
- `group_starts` [S + 2]: where each slot's rows start in sorted_rows, then where the base rows start, then
  max_tokens. A kernel clamps the last group to the rows it is given.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.transfer import to_device


class LoRARows:
    def __init__(self, max_tokens: int, slots: int, device: torch.device, grouped: bool) -> None:
        """grouped: keep the rows grouped by slot too (LoRAKernels.grouped)."""
        self.max_tokens = max_tokens
        self.num_slots = slots
        self.grouped = grouped
        self.device = device
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.sorted_rows = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self.group_starts = torch.zeros(slots + 2, dtype=torch.int64, device=device)
        self.group_starts[-1] = max_tokens
        self._filled = 0  # tokens written by the last step, reset by the next

    def fill(self, token_slots: list[int]) -> None:
        """This step's slots (its first len(token_slots) tokens); the rest, padding included, -1. One copy to
        the device for everything."""
        n = len(token_slots)
        if n > self.max_tokens:
            raise ValueError(f"a step of {n} tokens; the LoRA rows hold {self.max_tokens}")
        stale = max(self._filled - n, 0)  # the last step's rows past this one's: back to -1 and to themselves
        slots = np.asarray(token_slots, dtype=np.int64)
        parts = [slots, np.full(stale, -1, dtype=np.int64)]
        if self.grouped:
            key = np.where(slots < 0, self.num_slots, slots)
            counts = np.bincount(key, minlength=self.num_slots + 1)
            starts = np.concatenate(([0], np.cumsum(counts[: self.num_slots]), [self.max_tokens]))
            parts += [np.argsort(key, kind="stable"), np.arange(n, n + stale, dtype=np.int64), starts]
        packed = to_device(torch.from_numpy(np.concatenate(parts)), torch.int64, self.device)
        self.slots[: n + stale].copy_(packed[: n + stale])
        if self.grouped:
            self.sorted_rows[: n + stale].copy_(packed[n + stale : 2 * (n + stale)])
            self.group_starts.copy_(packed[2 * (n + stale) :])
        self._filled = n
