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
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n :]
            # Every window of n tokens that ends before the last token (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n  # the most recent occurrence
                drafts: list[int] = context[follow : follow + k].tolist()
                return drafts
        return []
