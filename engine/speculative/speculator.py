"""The engine's side of speculative decoding: which requests get drafts, from which proposer, and what a
verify step's sampled tokens mean for each request."""

from __future__ import annotations

from typing import Protocol

from engine.request import Request
from engine.scheduler import ScheduledStep
from engine.speculative.acceptance import SpecDecodeStats, accepted_length
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_model import DraftModelProposer
from engine.speculative.eagle3 import Eagle3Proposer
from engine.speculative.ngram import NgramProposer
from engine.step_message import FIRST_PENDING_DRAFT, StepMessage
from engine.structured.mask import grammar_drafts


class Proposer(Protocol):
    """Drafts for a batch of contexts (each request's tokens), at most each one's limit."""

    def propose_batch(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]: ...


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        draft_model: DraftModelProposer | None = None,
        eagle: Eagle3Proposer | None = None,
        drafts_on_device: bool = False,
    ) -> None:
        """draft_model: the proposer of the "draft_model" method (the engine builds its draft engine); eagle:
        the "eagle3" method's (it reads the requests' own state, and each target step's hidden states).
        drafts_on_device: an EAGLE-3 head's drafts stay on the device for the verify step, which the host
        builds and launches while the device still drafts (where the step runner reads input tokens on the
        device: the platforms with overlap scheduling); the host reads them after the step (`resolve`)."""
        self.config = config
        self.eagle = eagle
        self.drafts_on_device = drafts_on_device and eagle is not None
        low, high = config.lookup_range
        self.proposer: Proposer = (
            draft_model if draft_model is not None else NgramProposer(config.num_speculative_tokens, low, high)
        )
        self.stats = SpecDecodeStats()

    def describe(self) -> str:
        if self.config.method in ("draft_model", "eagle3"):
            kind = "EAGLE-3 head" if self.config.method == "eagle3" else "draft model"
            where = ", drafts left on the device for the verify step" if self.drafts_on_device else ""
            return f"{kind} {self.config.model}, {self.config.num_speculative_tokens} tokens{where}"
        low, high = self.config.lookup_range
        return f"{self.config.method}, {self.config.num_speculative_tokens} tokens, n-grams {low}-{high}"

    def draft(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """At most its limit of drafts for each request (the scheduler's drafter)."""
        cutoff = self.config.disable_by_batch_size
        if cutoff is not None and len(requests) >= cutoff:
            return [[] for _ in requests]
        if self.eagle is not None:
            # A grammar filters its request's drafts by value (below) before the step is built, and penalties
            # are applied to each row after the drafts before it (engine/sampler.py): read back for them.
            by_value = any(r.grammar is not None or r.params.has_penalties for r in requests)
            on_device = self.drafts_on_device and not by_value
            drafts = self.eagle.propose(requests, limits, on_device)
        else:
            drafts = self.proposer.propose_batch([r.all_token_ids for r in requests], limits)
        # A grammar's request verifies only the drafts its grammar allows (the matcher walks them and rolls back).
        return [grammar_drafts(r.grammar, d) if r.grammar is not None and d else d for r, d in zip(requests, drafts)]

    def observe(self, step: ScheduledStep, message: StepMessage) -> None:
        """A target step was launched: an EAGLE-3 head keeps its tokens' hidden states (nothing otherwise)."""
        if self.eagle is not None:
            self.eagle.observe(step, message)

    def forget(self, request: Request) -> None:
        """The request released its KV (finished, aborted, retracted): so does the head's cache of it."""
        if self.eagle is not None:
            self.eagle.forget(request)

    def resolve(self, drafts: list[list[int]]) -> None:
        """A launched verify step's drafts that stayed on the device (pending draft tokens) replaced in place
        by their values, read back: the host needs them only to see which the target kept."""
        if self.eagle is None or not any(d and d[0] <= FIRST_PENDING_DRAFT for d in drafts):
            return
        values = self.eagle.loop.read_drafts()
        for request_drafts in drafts:
            request_drafts[:] = [
                values[FIRST_PENDING_DRAFT - t] if t <= FIRST_PENDING_DRAFT else t for t in request_drafts
            ]

    def accept(self, drafts: list[int], sampled: list[int]) -> list[int]:
        """The tokens a request keeps from its verify rows: the drafts the target agreed with, then the
        target's own token after them."""
        n = accepted_length(drafts, sampled)
        self.stats.record(len(drafts), n)
        return sampled[: n + 1]
