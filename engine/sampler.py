"""Batched sampling with per-request parameters.

Order follows HF generate's processors: penalties, temperature, top-k, top-p,
min-p, then a draw. Greedy rows skip the draw; seeded rows draw from their own
generator so a seed reproduces regardless of batch composition.
"""

from __future__ import annotations

import torch

from engine.batch_state import PenaltyState
from engine.request import Request, TokenLogprob


def _apply_penalties(logits: torch.Tensor, requests: list[Request], penalties: PenaltyState | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Repetition (HF: every token seen in prompt or output, once), presence and frequency (OpenAI:
    counts over generated tokens) penalties for the whole batch at once, in place.

    Returns (decode rows, batch positions) of the penalized requests when their state lives in
    `penalties` (decode steps), so the sampled tokens can be recorded there; else None.
    """
    positions = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not positions:
        return None
    device, vocab = logits.device, logits.shape[1]
    penalized = [requests[i] for i in positions]
    index = torch.tensor(positions, device=device)
    recorded = None
    if penalties is not None and all(r.batch_row is not None for r in penalized):
        rows = penalties.rows_for(penalized)
        assert penalties.seen is not None and penalties.counts is not None
        seen, counts = penalties.seen[rows], penalties.counts[rows].to(logits.dtype)
        recorded = (rows, index)
    else:
        # The first token after a prefill (no decode row yet): from the token lists, once per request.
        seen = torch.zeros(len(penalized), vocab, dtype=torch.bool, device=device)
        counts = torch.zeros(len(penalized), vocab, dtype=logits.dtype, device=device)
        for row, request in enumerate(penalized):
            seen[row, torch.tensor(request.all_token_ids, device=device)] = True
            if request.output_token_ids:
                out = torch.tensor(request.output_token_ids, device=device)
                counts[row].index_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
    column = {"device": device, "dtype": logits.dtype}
    repetition = torch.tensor([r.params.repetition_penalty for r in penalized], **column).unsqueeze(1)
    frequency = torch.tensor([r.params.frequency_penalty for r in penalized], **column).unsqueeze(1)
    presence = torch.tensor([r.params.presence_penalty for r in penalized], **column).unsqueeze(1)
    values = logits[index]
    values = torch.where(seen, torch.where(values > 0, values / repetition, values * repetition), values)
    values = values - frequency * counts - presence * (counts > 0).to(logits.dtype)
    logits[index] = values
    return recorded


TOPK_PATH_MAX_K = 4096  # when every random row has a top_k at most this, candidates come from topk, not a full sort


def _candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, max_k: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered candidates of each row, best first: (logits [R, K], token ids [R, K]); dropped ones -inf.

    With a top_k on every row (max_k), one topk of max_k replaces the sort of the whole vocabulary
    (a 49k-entry sort is ~7 ms per 4 rows on a CPU core; a top-50 well under one).
    """
    vocab = logits.shape[1]
    if max_k is not None:
        sorted_logits, sorted_idx = logits.topk(min(max_k, vocab), dim=-1)
    else:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)
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
    return sorted_logits, sorted_idx


def sample(logits: torch.Tensor, requests: list[Request], penalties: PenaltyState | None = None) -> list[int]:
    """logits [batch, vocab] float32 -> one token id per request.

    Requests with params.logprobs get a TokenLogprob appended to output_logprobs. `penalties`:
    the decode rows' penalty state (decode steps), updated with the sampled tokens.
    """
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    # Raw logprobs of the model (vLLM's default): taken before penalties and temperature,
    # and before _apply_penalties edits the logits in place.
    raw_logprobs = logits[logprob_rows].float().log_softmax(dim=-1) if logprob_rows else None
    recorded = _apply_penalties(logits, requests, penalties)
    chosen_ids = _sample(logits, requests)
    if recorded is not None and penalties is not None:
        rows, index = recorded
        penalties.record(rows, chosen_ids[index])
    chosen = chosen_ids.tolist()  # the step's one host sync
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


def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Token ids [batch] on the logits' device, with no host sync.

    Greedy rows cost one argmax. Random rows are filtered together (temperature, top-k, top-p,
    min-p); unseeded ones are drawn together by the exponential race (argmax of p / Exp(1), a draw
    from p, as vLLM and SGLang sample), seeded ones each from its own generator over the whole
    vocabulary, so a seed gives the same tokens whatever the batch.
    """
    greedy_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not random_rows:
        return greedy_ids
    device = logits.device
    rows = torch.tensor(random_rows, device=device)
    params = [requests[i].params for i in random_rows]
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    scaled = logits[rows] / temperature.unsqueeze(1)
    top_ks = [p.top_k for p in params]
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        max_k = max(top_ks) if all(0 < k <= TOPK_PATH_MAX_K for k in top_ks) else None
        candidate_logits, candidate_ids = _candidates(
            scaled,
            torch.tensor(top_ks, device=device),
            torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype),
            torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype),
            max_k,
        )
    else:  # temperature alone: the whole vocabulary, unsorted
        candidate_logits = scaled
        candidate_ids = torch.arange(scaled.shape[1], device=device).expand(scaled.shape[0], -1)
    probs = candidate_logits.softmax(dim=-1)
    # Non-finite logits (a broken model or kernel) must not fail the draw for the whole batch: such a
    # row takes its argmax (the where() at the end; no host sync), and its garbage draw is discarded.
    broken = ~torch.isfinite(probs).all(dim=-1)
    picks = torch.empty(len(random_rows), dtype=torch.long, device=device)
    seeded = [p for p, row in enumerate(random_rows) if requests[row].generator is not None]
    unseeded = [p for p, row in enumerate(random_rows) if requests[row].generator is None]
    if unseeded:
        index = torch.tensor(unseeded, device=device)
        race = probs[index] / torch.empty_like(probs[index]).exponential_()
        picks[index] = candidate_ids[index].gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    for position in seeded:
        # A broken row would make multinomial raise: draw from a harmless stand-in, discarded below.
        row_probs = torch.where(broken[position], torch.ones_like(probs[position]), probs[position])
        full = torch.zeros(logits.shape[1], dtype=probs.dtype, device=device).scatter_(0, candidate_ids[position], row_probs)
        picks[position] = torch.multinomial(full, 1, generator=requests[random_rows[position]].generator)[0]
    chosen = greedy_ids.clone()
    chosen[rows] = torch.where(broken, greedy_ids[rows], picks)
    return chosen
