"""The engine's side of speculative decoding: which requests get drafts, from which proposer, and what a
verify step's sampled tokens mean for each request."""

from __future__ import annotations

from engine.request import Request
from engine.speculative.acceptance import SpecDecodeStats, accepted_length
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        low, high = config.lookup_range
        self.proposer = NgramProposer(config.num_speculative_tokens, low, high)
        self.stats = SpecDecodeStats()

    def describe(self) -> str:
        low, high = self.config.lookup_range
        return f"{self.config.method}, {self.config.num_speculative_tokens} tokens, n-grams {low}-{high}"

    @staticmethod
    def drafts_allowed(request: Request) -> bool:
        """Requests whose sampling reads per-token host state decode without drafts (exactly, one token a
        step): penalties count the tokens before each position, and logit edits (min_tokens, a grammar's
        mask) change with them, but a verify step samples every position from the state before its drafts."""
        return not request.params.has_penalties and not request.edits_logits

    def draft(self, request: Request, limit: int) -> list[int]:
        """At most `limit` drafts for the request (the scheduler's drafter)."""
        if not self.drafts_allowed(request):
            return []
        return self.proposer.propose(request.all_token_ids, limit)

    def accept(self, drafts: list[int], sampled: list[int]) -> list[int]:
        """The tokens a request keeps from its verify rows: the drafts the target agreed with, then the
        target's own token after them."""
        n = accepted_length(drafts, sampled)
        self.stats.record(len(drafts), n)
        return sampled[: n + 1]
