"""Drafts from a smaller model with the same vocabulary (vLLM's "draft_model" method).

The draft model runs as an engine of its own (its KV pool, its graphs, its scheduler), built by the target
engine and handed in. Each verify step asks it for every request's next k tokens, greedily, in one batch: a
draft request per target request whose prompt is the target's accepted tokens. Rollback is the draft engine's
prefix cache: a draft request ends after its k tokens and its full pages stay cached, so the next step's draft
request finds the accepted context cached and recomputes only the tokens past its last full page (at most a
page plus the newly accepted tokens); pages that hold rejected drafts are never matched again and age out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


class DraftEngine(Protocol):
    """What the proposer needs of the draft engine (engine.engine.Engine)."""

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams] | SamplingParams | None = None
    ) -> list[RequestOutput]: ...


class DraftModelProposer:
    def __init__(self, engine: DraftEngine, num_tokens: int, max_context: int) -> None:
        """max_context: the draft engine's context length (a longer context gets no drafts)."""
        self.engine = engine
        self.num_tokens = num_tokens
        self.max_context = max_context

    def propose_batch(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]:
        """Each context's next min(num_tokens, limit) tokens by the draft model's greedy decoding."""
        asked = [
            (i, min(self.num_tokens, limit))
            for i, (context, limit) in enumerate(zip(contexts, limits))
            if limit > 0 and len(context) + min(self.num_tokens, limit) < self.max_context
        ]
        drafts: list[list[int]] = [[] for _ in contexts]
        if not asked:
            return drafts
        outputs = self.engine.generate(
            [contexts[i] for i, _ in asked],
            [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in asked],
        )
        for (i, _), output in zip(asked, outputs):
            drafts[i] = output.token_ids
        return drafts
