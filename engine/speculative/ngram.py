"""Prompt lookup decoding: drafts copied from the request's own context.

Where the last n tokens occurred before (a quoted passage, a list being edited, code being rewritten), the
tokens that followed them then are a good guess for what follows now. The most recent earlier occurrence of
the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min) wins. No model, nothing on the device:
one vectorised scan of the context per request and step.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) drafts to follow `tokens`; empty when no suffix n-gram recurs."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        context = np.asarray(tokens, dtype=np.int64)
        # Earlier positions holding the last token: the candidates' ends. One pass over the context; then
        # each further suffix token filters them, so the work past the first pass is the candidates'.
        ends = np.flatnonzero(context[: length - 1] == context[length - 1])
        best, best_n, n = ends, 1, 1
        while n < min(self.max_n, length - 1) and ends.size:
            ends = ends[ends >= n]
            ends = ends[context[ends - n] == context[length - 1 - n]]
            n += 1
            if ends.size:
                best, best_n = ends, n
        if best.size == 0 or best_n < self.min_n:
            return []
        follow = int(best[-1]) + 1  # the most recent occurrence of the longest match
        drafts: list[int] = context[follow : follow + k].tolist()
        return drafts

    def propose_batch(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]:
        """propose() for each context, with its limit (0: no drafts)."""
        return [self.propose(context, limit) if limit > 0 else [] for context, limit in zip(contexts, limits)]
