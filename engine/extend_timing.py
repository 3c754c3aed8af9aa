"""How long an extend (prefill) step takes for its number of prompt tokens, learned from every step.

A step costs a fixed part (launches, the LM head, Python) plus a part per token. The scheduler keeps an extend
step under a time limit while other requests decode, so it asks how many tokens fit. Two things went wrong
with an average of the time per token over long steps only: the fixed part counted against every token, and
one slow step (a busy CPU) shrank every later chunk below the size that was measured, so nothing corrected it.

This model fits both parts over the last WINDOW steps of any size with the Theil-Sen estimator (the median of
the slopes between pairs of steps, then the median intercept): a line that one or two odd steps cannot move,
so a contended step is outvoted as soon as it happens, while a machine that stays slower moves the medians
within half a window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 8  # recent extend steps the fit reads
TRUSTED_STEPS = 3  # a budget grows to at most twice the largest of these last steps


@dataclass
class ExtendStepTime:
    """seconds ~= fixed_s + per_token_s * tokens over the recent steps."""

    fixed_s: float = 0.0
    per_token_s: float | None = None  # None until a step has been seen
    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, tokens: int, seconds: float) -> None:
        """One extend step of `tokens` prompt tokens took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        self.steps.append((tokens, seconds))
        steps = list(self.steps)
        slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(steps) for n2, t2 in steps[i + 1 :] if n2 != n1]
        slope = statistics.median(slopes) if slopes else 0.0
        intercept = statistics.median(t - slope * n for n, t in steps) if slope > 0 else -1.0
        if slope > 0 and intercept >= 0:
            self.fixed_s, self.per_token_s = intercept, slope
        else:
            # All steps of one size, or a line that would slope the wrong way: keep the fixed part found
            # last (none at first: all of the time counted per token, which gives the smallest budget).
            per_token = statistics.median((t - self.fixed_s) / n for n, t in steps)
            if per_token <= 0:  # steps now faster than the fixed part found before: count it all per token
                self.fixed_s, per_token = 0.0, statistics.median(t / n for n, t in steps)
            self.per_token_s = per_token

    def predict(self, tokens: int) -> float | None:
        """Seconds for a step of `tokens`; None before the first step."""
        return None if self.per_token_s is None else self.fixed_s + self.per_token_s * tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most prompt tokens a step may take to last at most `seconds` (0 when even its fixed part is over),
        and at most twice the largest of the last TRUSTED_STEPS steps: the line is only trusted near the sizes it
        was just measured at (while the window mixes a busy spell with quiet steps, its slope can come out far too
        low). None before the first step."""
        if self.per_token_s is None:
            return None
        fit = max(0, int((seconds - self.fixed_s) / self.per_token_s + 1e-6))  # 199.9999 is 200
        return min(fit, 2 * max(n for n, _ in list(self.steps)[-TRUSTED_STEPS:]))
