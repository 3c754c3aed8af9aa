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


def apply_grammar_masks(
    logits: torch.Tensor, requests: Sequence[Any], row_drafts: Sequence[tuple[int, list[int]]] | None = None
) -> None:
    """Set to -inf, in place, every logit a request's grammar forbids at its next position; in a verify step
    (`row_drafts`), at each row's position, after the drafts before it."""
    rows = constrained_rows(requests)
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    host = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=logits.is_cuda)
    first = [p for p, row in enumerate(rows) if row_drafts is None or row_drafts[row][0] == 0]
    _batch_matcher().batch_fill_next_token_bitmask([requests[rows[p]].grammar for p in first], host, first)
    if len(first) < len(rows):
        assert row_drafts is not None
        _fill_draft_rows(host, [requests[row] for row in rows], [row_drafts[row] for row in rows])
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


def _fill_draft_rows(host: torch.Tensor, requests: list[Any], row_drafts: list[tuple[int, list[int]]]) -> None:
    """The masks of a verify step's draft rows (host rows with j > 0; row j - 1 of the same request precedes
    each): the request's matcher takes its drafts one by one, each row's mask is filled after the drafts before
    it, and the matcher is rolled back to where it was. After a draft the grammar refuses or that ends it,
    the rows repeat the last mask: the target cannot keep that draft, so those rows are never used (the
    speculator drops such drafts before the step anyway)."""
    position = 0
    while position < len(requests):
        matcher = requests[position].grammar
        drafts = row_drafts[position][1]
        end = position + 1
        while end < len(requests) and row_drafts[end][0] > 0 and requests[end] is requests[position]:
            end += 1
        taken = 0
        for row in range(position + 1, end):
            token = drafts[row_drafts[row][0] - 1]
            if taken == row_drafts[row][0] - 1 and not matcher.is_terminated() and matcher.accept_token(token):
                taken += 1
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(host, row)
                    continue
            host[row] = host[row - 1]
        if taken:
            matcher.rollback(taken)
        position = end


def grammar_drafts(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of the drafts the grammar allows from the matcher's state (which it keeps): a draft
    it refuses can never be kept, so verifying it and those after it would be wasted rows."""
    taken = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        taken += 1
    if taken:
        matcher.rollback(taken)
    return drafts[:taken]


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
