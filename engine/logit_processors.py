"""Per-request edits of the logits before sampling: OpenAI's logit_bias, vLLM's min_tokens and
allowed_token_ids, and the grammars' masks.

In a verify step (speculative decoding) a request has a row per draft position: the bias and the allowed
tokens are the same on each, while min_tokens and a grammar's mask see the drafts before the row as taken
(`row_drafts`, ScheduledStep.logit_row_drafts).

Both touch a few entries of a few rows, so each is one scattered write for the whole batch (no
per-row launches), and both are skipped entirely when no request in the batch asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.structured.mask import apply_grammar_masks
from engine.transfer import to_device


def edit_logits(
    logits: torch.Tensor, requests: Sequence[Request], row_drafts: Sequence[tuple[int, list[int]]] | None = None
) -> None:
    """Every per-request edit, in place, before sampling: bias, allowed tokens, min_tokens, then the
    grammars' masks last (what a grammar forbids stays forbidden whatever the bias)."""
    apply_logit_bias(logits, requests)
    keep_allowed_tokens(logits, requests)
    block_early_stops(logits, requests, row_drafts)
    if any(r.grammar is not None for r in requests):
        apply_grammar_masks(logits, requests, row_drafts)


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """logits[row, token] += bias, in place, for every (token, bias) of every request's logit_bias."""
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for row, request in enumerate(requests):
        for token, bias in (request.params.logit_bias or {}).items():
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if not rows:
        return
    index = to_device([rows, tokens], torch.int64, logits.device)
    logits.index_put_(
        (index[0], index[1]), to_device(biases, torch.float32, logits.device).to(logits.dtype), accumulate=True
    )


def keep_allowed_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """-inf, in place, on every token outside a request's allowed_token_ids (one masked fill for all rows)."""
    rows = [row for row, request in enumerate(requests) if request.params.allowed_token_ids]
    if not rows:
        return
    allowed = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
    for position, row in enumerate(rows):
        allowed[position, requests[row].params.allowed_token_ids] = True
    allowed = allowed.to(logits.device, non_blocking=True)
    index = to_device(rows, torch.int64, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def block_early_stops(
    logits: torch.Tensor, requests: Sequence[Request], row_drafts: Sequence[tuple[int, list[int]]] | None = None
) -> None:
    """-inf, in place, on the tokens that would end a request (EOS, its stop_token_ids) while it has
    fewer than min_tokens new tokens. Counted with the token still in flight (overlap scheduling) and, in a
    verify step, the drafts before the row."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, request in enumerate(requests):
        produced = len(request.output_token_ids) + request.num_pending_tokens
        if row_drafts is not None:
            produced += row_drafts[row][0]
        if request.early_stop_ids and produced < request.params.min_tokens:
            rows += [row] * len(request.early_stop_ids)
            tokens += request.early_stop_ids
    if not rows:
        return
    index = to_device([rows, tokens], torch.int64, logits.device)
    logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
