"""Per-request sampling parameters, validated on creation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs; each one is a top-k over the vocabulary
# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny positive
# temperature overflows float32 to inf, and the softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # larger values are "the whole vocabulary"; the sampler clamps to the vocabulary size
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # logits scaled by at most 100x: still finite
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries per request (OpenAI documents 300); each is one scattered add


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token (echo)
    grammar: GrammarSpec | None = None  # structured output: what the text must match (engine/structured/)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    min_tokens: int = 0  # no EOS, stop token or stop string before this many new tokens (vLLM's)
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    # vLLM's cache_salt: requests share prefix-cache pages only with requests of the same salt (None: the
    # unsalted namespace), so a tenant cannot learn from timings or counters what another one has cached.
    cache_salt: str | None = None
    # The LoRA adapter this request runs with (its name as loaded; engine/lora/), None: the base model.
    lora_name: str | None = None
    # The requests of one API call (its prompts x n choices) share a group: the scheduler admits groups in
    # turn, so one call cannot hold every running slot while another waits (engine/scheduler.py). None: the
    # request is a group of its own.
    group: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def cache_namespace(self) -> str | None:
        """The prefix-cache namespace: the salt, and the adapter (KV is never shared between adapters)."""
        if self.lora_name is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x1flora:{self.lora_name}"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Every value a sampler could choke on is refused here, so one request can never fail a batch."""
        problems = []
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        bad_floats = [name for name in floats if not _is_finite_number(getattr(self, name))]
        for name in bad_floats:
            problems.append(f"{name} must be a finite number, got {getattr(self, name)!r}")
        checks: dict[str, tuple[Callable[[float], bool], str]] = {
            "temperature": (lambda v: v >= 0, "must be >= 0"),
            "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
            "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
            "repetition_penalty": (
                lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
            ),
            "presence_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
            "frequency_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
        }
        for name, (ok, rule) in checks.items():
            if name not in bad_floats and not ok(getattr(self, name)):
                problems.append(f"{name} {rule}, got {getattr(self, name)!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K):
            problems.append(f"top_k must be -1 (disabled) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop must be non-empty strings")
        elif len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            problems.append(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters each"
            )
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be non-negative integers")
        elif len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            problems.append(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                problems.append(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        # torch.Generator.manual_seed takes any 64-bit value, signed or unsigned.
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            problems.append(f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                problems.append(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers")
            elif any(
                not _is_int(t) or t < 0 or not _is_finite_number(b) or not -100 <= b <= 100
                for t, b in self.logit_bias.items()
            ):
                problems.append("logit_bias maps non-negative token ids to numbers in [-100, 100]")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            problems.append("allowed_token_ids must be a non-empty list of non-negative token ids")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            problems.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        elif _is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("cache_salt", "group"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                problems.append(f"{name} must be a non-empty string or None, got {value!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            problems.append(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        if problems:
            raise InvalidRequestError("invalid sampling parameters: " + "; ".join(problems))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
