"""Which drafts a verify step keeps, and the counters users read (vLLM's names).

The target model samples every position of a verify step as it would have sampled it without drafts (the
same processors, temperature, top-k/p, min-p, the request's generator). With drafts that are single tokens
(n-gram: a draft distribution that puts all its mass on one token), the standard speculative sampling rule
(accept draft d with probability min(1, p(d) / q(d)) = p(d), on rejection draw from the residual max(0, p - q),
which is p without d, renormalised) gives the same tokens in distribution as drawing x ~ p and accepting the
draft exactly when x == d; on the first mismatch x is the token drawn from the residual. So the rule is: keep
the longest prefix of drafts that equals the sampled tokens, then the sampled token after it. Greedy rows are
the special case where the draw is the argmax: the output is identical to decoding without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the target agreed with: the longest prefix where sampled[i] == drafts[i]."""
    n = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        n += 1
    return n


@dataclass
class SpecDecodeStats:
    """Counters since start: drafts proposed (one per request and verify step with drafts), draft tokens,
    accepted draft tokens, and how often the draft at each position was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step and request: the accepted drafts plus the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
