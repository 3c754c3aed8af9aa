"""The target model's hidden states at a few inner layers, kept for an EAGLE-3 head.

An EAGLE-3 head reads the residual stream entering three of the target's layers (vLLM's and SGLang's
"aux hidden states") at every position the target computes. Every loop over the decoder layers (the eager
forward, the compiled decode and extend steps) calls `record` before each layer and once after the last,
and the tap copies the layers it wants into one persistent buffer: a copy into a fixed buffer is also what
a captured device graph replays, so the buffer holds the step's states whichever runner ran it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's and SGLang's choice when the head's config names none: the streams entering layers 2, L // 2
    and L - 3 (low, middle and high features)."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


class AuxHiddenTap:
    """Copies the residual stream entering the chosen layers into `buffer` [tokens, len(layers) * hidden];
    layer index num_layers is the stream after the last layer (before the final norm)."""

    def __init__(
        self, layers: Sequence[int], hidden_size: int, max_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layers = list(layers)
        self.hidden_size = hidden_size
        self.columns: dict[int, list[slice]] = {}
        for slot, layer in enumerate(self.layers):
            self.columns.setdefault(layer, []).append(slice(slot * hidden_size, (slot + 1) * hidden_size))
        self.buffer = torch.zeros(max(max_tokens, 1), len(self.layers) * hidden_size, dtype=dtype, device=device)

    @property
    def width(self) -> int:
        return self.buffer.shape[1]

    def record(self, layer_index: int, hidden: torch.Tensor) -> None:
        """`hidden` [tokens, hidden] is the stream entering layer `layer_index`: copied if it is one we keep."""
        columns = self.columns.get(layer_index)
        if columns is None:
            return
        tokens = hidden.shape[0]
        if tokens > self.buffer.shape[0]:
            # An eager step larger than any planned (never a captured one: those are sized up front).
            grown = torch.zeros(tokens, self.width, dtype=self.buffer.dtype, device=self.buffer.device)
            self.buffer = grown
        for column in columns:
            self.buffer[:tokens, column].copy_(hidden)

    def rows(self, num_tokens: int) -> torch.Tensor:
        """The last step's states of its first num_tokens tokens (a padded step's padding rows left out)."""
        return self.buffer[:num_tokens]
