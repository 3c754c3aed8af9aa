"""Batched sampling with per-request parameters.

Order follows HF generate's processors: penalties, temperature, top-k, top-p,
min-p, then a draw. Greedy rows skip the draw; seeded rows draw from their own
generator so a seed reproduces regardless of batch composition.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.logit_processors import edit_logits
from engine.penalties import PenaltyState
from engine.request import Request, TokenLogprob
from engine.transfer import HostCopy, to_device

# (logits [batch, vocab] float32, batch positions, decode rows, seen, counts or None, repetition, frequency,
# presence) -> logits penalized in place: one launch for the whole batch.
PenaltyKernel = Callable[..., torch.Tensor]
# A device's penalty kernel, by torch device type: a backend registers its own when its platform module loads
# (backends/cuda/platform.py: Triton, for CUDA and HIP devices alike). Elsewhere the torch ops below run.
PENALTY_KERNELS: dict[str, PenaltyKernel] = {}


def _apply_penalties(
    logits: torch.Tensor,
    requests: list[Request],
    penalties: PenaltyState,
    rows: torch.Tensor,
    row_drafts: list[tuple[int, list[int]]] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """Repetition (HF: every token seen in prompt or output, once), presence and frequency (OpenAI:
    counts over generated tokens) penalties for the whole batch at once.

    The seen/counts state lives in each request's decode row (`rows`, on the device). Returns the
    penalized logits and (penalized rows, their batch positions or None for all) so the sampled
    tokens can be recorded there; None when no request is penalized. Each full-vocabulary pass costs
    ~0.1 ms at batch 256 on an H200, so there are as few as the requests need: no gather when every
    row is penalized, no counts without a frequency or presence penalty.

    A verify step's row after j drafts (`row_drafts`) is penalized as if those drafts were taken: every row
    of a request reads the state from before its drafts, and the logits of the tokens among the j drafts are
    penalized again afterwards from their raw values (`_penalize_drafted`).
    """
    positions = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not positions:
        return logits, None
    drafted = _drafted_tokens(positions, row_drafts, logits.device)
    raw = logits[drafted[0], drafted[1]] if drafted is not None else None  # before the kernel edits them
    logits, recorded = _penalize(logits, requests, penalties, rows, positions)
    if drafted is not None and raw is not None:
        _penalize_drafted(logits, raw, drafted, requests, penalties, rows)
    return logits, recorded


def _drafted_tokens(
    positions: list[int], row_drafts: list[tuple[int, list[int]]] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None:
    """(batch rows and token ids on the device, how often each token is among the drafts before its row, the
    batch rows on the host) of the penalized rows that follow drafts; None where none does."""
    if row_drafts is None:
        return None
    batch_rows: list[int] = []
    token_ids: list[int] = []
    repeats: list[int] = []
    for position in positions:
        taken, drafts = row_drafts[position]
        for token, count in collections.Counter(drafts[:taken]).items():
            batch_rows.append(position)
            token_ids.append(token)
            repeats.append(count)
    if not batch_rows:
        return None
    pairs = to_device([batch_rows, token_ids], torch.int64, device)
    return pairs[0], pairs[1], repeats, batch_rows


def _penalize_drafted(
    logits: torch.Tensor,
    raw: torch.Tensor,
    drafted: tuple[torch.Tensor, torch.Tensor, list[int], list[int]],
    requests: list[Request],
    penalties: PenaltyState,
    rows: torch.Tensor,
) -> None:
    """The logits of tokens among a row's drafts, penalized from their raw values as seen (repetition) and
    generated once more per occurrence (frequency; presence: now present), on top of the row's state."""
    assert penalties.counts is not None
    device = logits.device
    batch_rows, token_ids, repeats, host_rows = drafted
    params = [requests[b].params for b in host_rows]
    values = to_device(
        [
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
            [float(n) for n in repeats],
        ],
        torch.float32,
        device,
    ).to(logits.dtype)
    repetition, frequency, presence, extra = values[0], values[1], values[2], values[3]
    counts = penalties.counts[rows.index_select(0, batch_rows), token_ids].to(logits.dtype) + extra
    scores = torch.where(raw > 0, raw / repetition, raw * repetition)
    logits[batch_rows, token_ids] = scores - frequency * counts - presence


def _penalize(
    logits: torch.Tensor, requests: list[Request], penalties: PenaltyState, rows: torch.Tensor, positions: list[int]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every penalized row from its decode row's state (`_apply_penalties`)."""
    device = logits.device
    penalized = [requests[i] for i in positions]
    everyone = len(positions) == len(requests)
    index = None if everyone else to_device(positions, torch.int64, device)
    penalty_rows = rows if index is None else rows.index_select(0, index)
    penalties.fill_new_rows(penalized)
    assert penalties.seen is not None and penalties.counts is not None
    values = (
        to_device(
            [
                [r.params.repetition_penalty for r in penalized],
                [r.params.frequency_penalty for r in penalized],
                [r.params.presence_penalty for r in penalized],
            ],
            torch.float32,
            device,
        )
        .to(logits.dtype)
        .unsqueeze(2)
    )
    repetition, frequency, presence = values[0], values[1], values[2]
    has_counts = any(r.params.frequency_penalty or r.params.presence_penalty for r in penalized)
    kernel = PENALTY_KERNELS.get(device.type)
    if kernel is not None and logits.dtype == torch.float32:
        batch_positions = torch.arange(len(requests), device=device) if index is None else index
        kernel(
            logits,
            batch_positions,
            penalty_rows,
            penalties.seen,
            penalties.counts if has_counts else None,
            *values.float().squeeze(2),
        )
        return logits, (penalty_rows, index)
    scores = logits if index is None else logits.index_select(0, index)
    if any(r.params.repetition_penalty != 1.0 for r in penalized):
        seen = penalties.seen.index_select(0, penalty_rows)
        scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
    if has_counts:
        counts = penalties.counts.index_select(0, penalty_rows).to(logits.dtype)
        scores = scores - frequency * counts - presence * (counts > 0).to(logits.dtype)
    if index is None:
        return scores, (penalty_rows, None)
    return logits.index_copy(0, index, scores), (penalty_rows, index)


TOPK_PATH_MAX_K = 4096  # when every random row has a top_k at most this, candidates come from topk, not a full sort


def _filter_sorted(
    sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Candidates [R, K] sorted best first -> the same with the dropped ones at -inf (top-k, top-p, min-p)."""
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=sorted_logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p. The first token always stays, even where
    # top_p rounds to 0 in float32 (1e-300): a row with nothing left would softmax to NaN.
    cumulative_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((cumulative_before >= top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    threshold = probs[:, :1] * min_p.unsqueeze(1)
    return sorted_logits.masked_fill(probs < threshold, float("-inf"))


@dataclass
class LogprobGroup:
    """Logprobs of the rows that asked for the same number of alternatives (device tensors)."""

    positions: list[int]  # batch positions of these rows
    chosen: torch.Tensor  # [m] logprob of each row's sampled token
    top_values: torch.Tensor | None  # [m, k], best first; None when k == 0
    top_ids: torch.Tensor | None


@dataclass
class SampledTokens:
    """One step's draws, still on the device. `resolve()` is the step's one wait for the device.

    Launching the next step does not need them on the host: its input tokens are read from the
    decode rows on the device (DecodeBatchState.last_tokens). The host copy starts as soon as the
    step is launched, so when the engine gets to these results they are usually there already.
    """

    token_ids: torch.Tensor  # [n] int64, one per sampled request
    logprob_groups: list[LogprobGroup] = field(default_factory=list)
    _copy: HostCopy | None = None
    _resolved: tuple[list[int], list[TokenLogprob | None]] | None = None

    def start_copy(self) -> SampledTokens:
        tensors = [self.token_ids]
        for group in self.logprob_groups:
            tensors.append(group.chosen)
            if group.top_values is not None and group.top_ids is not None:
                tensors += [group.top_values, group.top_ids]
        self._copy = HostCopy(tensors)
        return self

    def resolve(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """(token id per row, TokenLogprob per row or None where the request asked for none)."""
        if self._resolved is None:
            if self._copy is None:
                self.start_copy()
            assert self._copy is not None
            host = iter(self._copy.get())
            tokens = next(host).tolist()
            entries: list[TokenLogprob | None] = [None] * len(tokens)
            for group in self.logprob_groups:
                chosen = next(host).tolist()
                tops: list[list[tuple[int, float]]] = [[] for _ in group.positions]
                if group.top_values is not None:
                    values, ids = next(host).tolist(), next(host).tolist()
                    tops = [list(zip(i, v)) for i, v in zip(ids, values)]
                for position, logprob, top in zip(group.positions, chosen, tops):
                    entries[position] = TokenLogprob(tokens[position], float(logprob), top)
            self._resolved = (tokens, entries)
        return self._resolved


def sample(
    logits: torch.Tensor,
    requests: list[Request],
    penalties: PenaltyState | None = None,
    rows: torch.Tensor | None = None,
    row_drafts: list[tuple[int, list[int]]] | None = None,
) -> SampledTokens:
    """logits [batch, vocab] float32 -> one token id per request, on the device (no host sync).

    `rows`: each request's decode row (device) where the penalty state lives; needed when any
    request has penalties. `row_drafts`: a verify step's drafts before each row
    (ScheduledStep.logit_row_drafts). Logprobs (params.logprobs) come with the result, for the rows that ask.
    """
    device = logits.device
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    # Raw logprobs of the model (vLLM's default): taken before penalties and temperature,
    # and before _apply_penalties edits the logits in place.
    raw_logprobs = None
    if logprob_rows:
        raw_logprobs = logits.index_select(0, to_device(logprob_rows, torch.int64, device)).float().log_softmax(dim=-1)
    recorded = None
    if any(r.params.has_penalties for r in requests):
        if penalties is None or rows is None:
            raise ValueError("penalized requests need their decode rows (DecodeBatchState) to sample")
        logits, recorded = _apply_penalties(logits, requests, penalties, rows, row_drafts)
    if any(r.edits_logits for r in requests):  # one pass over the batch; the common step stops here
        edit_logits(logits, requests, row_drafts)
    chosen_ids = _sample(logits, requests)
    # A verify step's rows are not all taken: the engine records the kept tokens (Engine._complete_verify).
    if recorded is not None and penalties is not None and row_drafts is None:
        penalty_rows, index = recorded
        penalties.record(penalty_rows, chosen_ids if index is None else chosen_ids.index_select(0, index))
    groups: list[LogprobGroup] = []
    if raw_logprobs is not None:
        for top_k in sorted({requests[row].params.logprobs or 0 for row in logprob_rows}):
            # One batched gather/top-k per distinct top_k, not one per row.
            members = [p for p, row in enumerate(logprob_rows) if (requests[row].params.logprobs or 0) == top_k]
            positions = [logprob_rows[p] for p in members]
            group_logprobs = raw_logprobs.index_select(0, to_device(members, torch.int64, device))
            chosen = chosen_ids.index_select(0, to_device(positions, torch.int64, device))
            chosen_logprob = group_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
            values = ids = None
            if top_k > 0:
                values, ids = group_logprobs.topk(top_k, dim=-1)
            groups.append(LogprobGroup(positions, chosen_logprob, values, ids))
    return SampledTokens(chosen_ids, groups)


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
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not random_rows:
        return logits.argmax(dim=-1)
    device, vocab = logits.device, logits.shape[1]
    everyone = len(random_rows) == len(requests)  # then no gather of the rows and no argmax of the whole batch
    params = [requests[i].params for i in random_rows]
    top_ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    # One host-to-device copy for every per-row value: row index, temperature, top-k, top-p, min-p.
    columns = to_device(
        [random_rows, [p.temperature for p in params], top_ks, [p.top_p for p in params], [p.min_p for p in params]],
        torch.float32,
        device,  # exact: row indices and top-k values stay far below 2**24
    )
    rows = columns[0].long()
    subset = logits if everyone else logits.index_select(0, rows)
    temperature = columns[1].to(logits.dtype).unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        max_k = max(top_ks) if all(0 < k <= TOPK_PATH_MAX_K for k in top_ks) else None
        if max_k is not None:
            # The top max_k of the logits are those of logits / temperature (a positive scale keeps the
            # order): one topk, and only the candidates are scaled (a 49k-entry sort is ~7 ms per 4 rows
            # on a CPU core; a full-vocabulary division ~0.1 ms at batch 256 on an H200).
            values, candidate_ids = subset.topk(min(max_k, vocab), dim=-1)
            candidate_logits = values / temperature
        else:
            candidate_logits, candidate_ids = (subset / temperature).sort(dim=-1, descending=True)
        candidate_logits = _filter_sorted(
            candidate_logits, columns[2].long(), columns[3].to(logits.dtype), columns[4].to(logits.dtype), vocab
        )
        best = candidate_ids[:, 0]  # each row's argmax, from the sort
    else:  # temperature alone: the whole vocabulary, unsorted
        candidate_logits = subset / temperature
        candidate_ids = torch.arange(vocab, device=device).expand(subset.shape[0], -1)
        best = subset.argmax(dim=-1)
    probs = candidate_logits.softmax(dim=-1)
    # Non-finite logits (a broken model or kernel) must not fail the draw for the whole batch: such a
    # row takes its argmax (the where() at the end; no host sync), and its garbage draw is discarded.
    broken = ~torch.isfinite(probs).all(dim=-1)
    picks = torch.empty(len(random_rows), dtype=torch.long, device=device)
    seeded = [p for p, row in enumerate(random_rows) if requests[row].generator is not None]
    unseeded = [p for p, row in enumerate(random_rows) if requests[row].generator is None]
    if unseeded:
        index = to_device(unseeded, torch.int64, device) if seeded else None
        group = probs if index is None else probs.index_select(0, index)
        race = group / torch.empty_like(group).exponential_()
        group_ids = candidate_ids if index is None else candidate_ids.index_select(0, index)
        drawn = group_ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
        if index is None:
            picks = drawn
        else:
            picks.index_copy_(0, index, drawn)
    for position in seeded:
        # The draw torch.multinomial(full, 1, generator) makes (argmax of p / Exp(1) noise over the whole
        # vocabulary, from the request's generator), without its validity check: that is an .item(),
        # a host sync per seeded row. So a seed gives the tokens it gave before, and a broken row a
        # garbage pick that the where() below discards.
        full = torch.zeros(vocab, dtype=probs.dtype, device=device).scatter_(
            0, candidate_ids[position], probs[position]
        )
        noise = torch.empty_like(full).exponential_(generator=requests[random_rows[position]].generator)
        picks[position] = full.div_(noise).argmax()
    chosen = torch.where(broken, best, picks)
    if everyone:
        return chosen
    return logits.argmax(dim=-1).index_copy(0, rows, chosen)
