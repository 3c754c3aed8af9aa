"""Batched sampling with per-request parameters.

Order follows HF generate's processors: penalties, temperature, top-k, top-p,
min-p, then a draw. Greedy rows skip the draw; seeded rows draw from their own
generator so a seed reproduces regardless of batch composition.
"""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprob


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    for row, request in enumerate(requests):
        p = request.params
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            continue
        device = logits.device
        if p.repetition_penalty != 1.0:
            # HF semantics: every token seen in prompt or output is penalised once.
            seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if request.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            # OpenAI semantics: counts over generated tokens only.
            out = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p. The first token always stays, even where
    # top_p rounds to 0 in float32 (1e-300): a row with nothing left would softmax to NaN.
    cumulative_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((cumulative_before >= top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    threshold = probs[:, :1] * min_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(probs < threshold, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [batch, vocab] float32 -> one token id per request.

    Requests with params.logprobs get a TokenLogprob appended to output_logprobs.
    """
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    # Raw logprobs of the model (vLLM's default): taken before penalties and temperature,
    # and before _apply_penalties edits the logits in place.
    raw_logprobs = logits[logprob_rows].float().log_softmax(dim=-1) if logprob_rows else None
    chosen = _sample(logits, requests)
    if raw_logprobs is not None:
        for top_k in {requests[row].params.logprobs or 0 for row in logprob_rows}:
            # One batched gather/top-k (and one host transfer) per distinct top_k, not one per row.
            positions = [p for p, row in enumerate(logprob_rows) if (requests[row].params.logprobs or 0) == top_k]
            entries = _token_logprobs(raw_logprobs[positions], [chosen[logprob_rows[p]] for p in positions], top_k)
            for position, entry in zip(positions, entries):
                requests[logprob_rows[position]].output_logprobs.append(entry)
    return chosen


def _token_logprobs(logprobs: torch.Tensor, token_ids: list[int], top_k: int) -> list[TokenLogprob]:
    """logprobs [n, vocab] -> each row's entry for token_ids[row], with its top_k alternatives."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top_k > 0:
        values, ids = logprobs.topk(top_k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(int(t), float(lp), top) for t, lp, top in zip(token_ids, chosen, tops)]


def record_prompt_logprobs(request: Request, logits: torch.Tensor, positions: list[int]) -> None:
    """Append prompt-token logprobs from the logits [len(positions), vocab] of one extend segment.

    The logits at position p predict prompt token p + 1. Entries are appended only where they
    extend the list in order, so a recompute after preemption (or a later chunk) adds nothing twice.
    """
    prompt = request.prompt_token_ids
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None]
    rows = [row for row, position in enumerate(positions) if position + 1 < len(prompt)]
    start = len(request.prompt_logprobs)  # the next prompt position without an entry
    rows = [row for row in rows if positions[row] + 1 >= start]
    if not rows or positions[rows[0]] + 1 != start:
        return
    logprobs = logits[rows].float().log_softmax(dim=-1)
    targets = [prompt[positions[row] + 1] for row in rows]
    request.prompt_logprobs.extend(_token_logprobs(logprobs, targets, request.params.prompt_logprobs or 0))


def _sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    _apply_penalties(logits, requests)
    greedy_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not random_rows:
        return greedy_ids.tolist()
    device = logits.device
    rows = torch.tensor(random_rows, device=device)
    params = [requests[i].params for i in random_rows]
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    scaled = logits[rows] / temperature.unsqueeze(1)
    needs_filter = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
    if needs_filter:
        scaled = _top_k_top_p_min_p(
            scaled,
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype),
            torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype),
        )
    probs = scaled.softmax(dim=-1)
    # Non-finite logits (a broken model or kernel) would make multinomial raise for the whole batch:
    # such a row takes its argmax instead, so the rows beside it still sample.
    broken = ~torch.isfinite(probs).all(dim=-1)
    if bool(broken.any()):
        probs[broken] = torch.nn.functional.one_hot(greedy_ids[rows][broken], probs.shape[-1]).to(probs.dtype)
    chosen = greedy_ids.clone()
    for position, row in enumerate(random_rows):
        generator = requests[row].generator
        token = torch.multinomial(probs[position], 1, generator=generator)
        chosen[row] = token[0]
    return chosen.tolist()
