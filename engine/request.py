"""One generation request and its lifecycle state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    """Log-probability of one token, with the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: `request in running` must not compare every field (O(n) per test)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int = 0  # tokens whose k/v are in the pool
    output_text: str = ""
    num_text_sent: int = 0  # characters of output_text already streamed
    detokenizer: Any = None  # IncrementalDetokenizer, made on the first output token
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    # KV held through the prefix cache: a cached prefix shared with other requests (locked while
    # this request lives) and the radix node that ends it; private pages follow in the page table.
    shared_pages: list[int] = field(default_factory=list)
    cache_node: Any = None
    # Filled by the sampler when params.logprobs is set: one entry per output token.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Filled during the extend step when params.prompt_logprobs is set: entry 0 is None
    # (nothing predicts the first prompt token), as in vLLM and OpenAI's echo.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Its row in the persistent decode state (DecodeBatchState, graphs/model_runner.py) while it decodes, and how many
    # of its pages that row already holds on the device.
    batch_row: int | None = None
    batch_row_pages: int = 0
    lora_slot: int = -1  # the device slot of its LoRA adapter (engine/lora/), -1: the base model
    # Tokens sampled by launched steps that the host has not processed yet (overlap scheduling: the
    # next step is launched before the last one's tokens are read back). 0 or 1 whenever the
    # scheduler runs; their k/v positions follow num_tokens.
    num_pending_tokens: int = 0
    # Structured output: the xgrammar matcher of params.grammar, advanced by each output token.
    grammar: Any = None
    grammar_guard: Any = None  # JSON grammars: a bitmask ANDed with the grammar's (engine/structured/compiler.py)
    # params.min_tokens: the tokens that would end it early (EOS and stop_token_ids), masked until then.
    early_stop_ids: list[int] = field(default_factory=list)
    # The sampler edits this request's logits (bias, allowed tokens, min_tokens, grammar): derived once
    # from params here, so a decode step checks one flag per row rather than every field.
    edits_logits: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        self.edits_logits = bool(p.logit_bias or p.allowed_token_ids or p.min_tokens or p.grammar is not None)

    @property
    def last_token_id(self) -> int:
        """The token the next decode step feeds (no list concatenation: O(1))."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the request has, counting those still on the device: the next step feeds the last."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What generate() returns and stream() yields (delta fields for streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # Only when the request asked for them (params.logprobs / params.prompt_logprobs).
    logprobs: list[TokenLogprob] | None = None  # every output token so far
    new_logprobs: list[TokenLogprob] | None = None  # those of new_token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once complete
    # Set when this request's step failed because of it (finish_reason "error"); the others went on.
    error: str | None = None
