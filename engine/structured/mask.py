"""The grammars' token masks applied to a batch's logits: one bitmask fill for every constrained
row (xgrammar's batch matcher, on the host), one copy to the device, one masked fill.

Outside any captured graph: the logits come out of the graph (or the eager step) and are masked
before sampling, so the decode graphs stay the same whether or not a request has a grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from engine.structured.spec import import_xgrammar
from engine.transfer import to_device

_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def constrained_rows(requests: Sequence[Any]) -> list[int]:
    """Batch positions of the requests whose grammar still decides what may come next."""
    return [i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated()]


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Any]) -> None:
    """Set to -inf, in place, every logit a request's grammar forbids at its next position."""
    rows = constrained_rows(requests)
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    host = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=logits.is_cuda)
    _batch_matcher().batch_fill_next_token_bitmask([requests[i].grammar for i in rows], host)
    for position, row in enumerate(rows):
        guard = requests[row].grammar_guard
        if guard is not None:
            host[position] &= guard
    forbidden = forbidden_tokens(host.to(logits.device, non_blocking=True), vocab)
    if len(rows) == len(requests):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = to_device(rows, torch.int64, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))


@lru_cache(maxsize=1)
def _batch_matcher() -> Any:
    """xgrammar's multi-threaded mask filler, made on the first constrained step."""
    return import_xgrammar().BatchGrammarMatcher()


def forbidden_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)] (bit j of word w set: token 32w + j allowed) -> bool [rows, vocab],
    True where a token is not allowed. One AND against the 32 bit values and one compare, on any device."""
    bits = _BIT_VALUES.get(bitmask.device)
    if bits is None:
        values = [1 << j if j < 31 else -(1 << 31) for j in range(32)]  # bit 31 is int32's sign bit
        bits = _BIT_VALUES[bitmask.device] = torch.tensor(values, dtype=torch.int32, device=bitmask.device)
    return (bitmask.unsqueeze(-1) & bits).eq(0).view(bitmask.shape[0], -1)[:, :vocab]
