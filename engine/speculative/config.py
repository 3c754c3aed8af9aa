"""`--speculative-config`: vLLM's JSON keys for the methods the engine has."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods whose `model` is a path
# vLLM's other methods, refused by name until the engine has them.
NOT_YET = ("eagle", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to propose and how many drafts per step. ngram: drafts copied from the request's own tokens
    after the most recent earlier occurrence of its last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min (prompt lookup decoding; vLLM's "ngram" method). draft_model: a smaller model with the
    same vocabulary (`model`: a path or preset, as --model takes) decodes the drafts greedily. eagle3: an
    EAGLE-3 head (`model`: its folder in the public layout, or "dummy" for random weights of the target's
    shape) drafts from the target's hidden states."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    # No drafts in a step of this many running requests or more (vLLM's key): where verify rows would make the
    # step bound by compute, plain decode steps are faster.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(
                f"--speculative-config method {self.method!r} is not supported yet; methods: {', '.join(METHODS)}"
            )
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method in MODEL_METHODS) != (self.model is not None):
            raise ValueError(
                "--speculative-config: a draft model's path goes with methods draft_model and eagle3, and only there"
                f" (method {self.method!r}, model {self.model!r})"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(
                f"--speculative-config disable_by_batch_size must be >= 2, got {self.disable_by_batch_size}"
            )
        low, high = self.lookup_range
        if not 1 <= low <= high:
            raise ValueError(
                f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}"
            )

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(smallest, largest) n-gram matched: vLLM's defaults, one bound standing for both when alone."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return DEFAULT_LOOKUP, DEFAULT_LOOKUP
        return (low if low is not None else high or 0), (high if high is not None else low or 0)

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config from the flag's JSON (or a dict); None or empty: no speculation. Unknown keys are refused."""
        if not text:
            return None
        if isinstance(text, str):
            try:
                values = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        else:
            values = text
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            known_keys = ", ".join(sorted(known))
            raise ValueError(f"--speculative-config: unsupported keys {', '.join(unknown)}; known: {known_keys}")
        if "method" not in values and "model" in values:  # vLLM infers a draft model from its path
            values = {**values, "method": "draft_model"}
        for key in ("method", "num_speculative_tokens"):
            if key not in values:
                raise ValueError(f"--speculative-config needs {key!r}")
        if values["method"] == "[ngram]":  # vLLM's older spelling
            values = {**values, "method": "ngram"}
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = values.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config {key} must be an integer, got {value!r}")
        return cls(**values)


# SGLang's --speculative-algorithm names: the method each maps to, or None (refused until the engine has it).
SGLANG_ALGORITHMS: dict[str, str | None] = {
    "NGRAM": "ngram",
    "STANDALONE": "draft_model",
    "EAGLE": None,
    "EAGLE3": "eagle3",
    "NEXTN": None,
}


def sglang_speculative_config(
    algorithm: str | None,
    num_steps: int | None,
    num_draft_tokens: int | None,
    draft_model_path: str | None,
    eagle_topk: int | None,
) -> dict[str, Any] | None:
    """SGLang's flags as --speculative-config's keys (None: no SGLang flag given). Chain drafts only: SGLang's
    num_draft_tokens counts the verified token too, so a chain of k drafts is num_steps k, num_draft_tokens k + 1."""
    given = [num_steps, num_draft_tokens, draft_model_path, eagle_topk]
    if algorithm is None:
        if any(value is not None for value in given):
            raise ValueError(
                "--speculative-num-steps, --speculative-num-draft-tokens, --speculative-draft-model-path and "
                "--speculative-eagle-topk go with --speculative-algorithm"
            )
        return None
    name = algorithm.upper()
    if name not in SGLANG_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm must be one of {', '.join(SGLANG_ALGORITHMS)}, got {algorithm!r}")
    method = SGLANG_ALGORITHMS[name]
    if method is None:
        supported = ", ".join(name for name, method in SGLANG_ALGORITHMS.items() if method is not None)
        raise ValueError(f"--speculative-algorithm {name} is not supported yet; algorithms: {supported}")
    if eagle_topk not in (None, 1):
        raise ValueError(
            f"--speculative-eagle-topk {eagle_topk}: tree drafts are not supported (chains: --speculative-eagle-topk 1)"
        )
    if num_steps is None and num_draft_tokens is None:
        raise ValueError("--speculative-algorithm needs --speculative-num-steps or --speculative-num-draft-tokens")
    drafts = num_steps if num_steps is not None else int(num_draft_tokens or 0) - 1
    if num_draft_tokens is not None and num_draft_tokens != drafts + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} with --speculative-num-steps {num_steps}: a chain "
            f"of {drafts} drafts verifies {drafts + 1} tokens (tree drafts are not supported)"
        )
    if (method in MODEL_METHODS) != (draft_model_path is not None):
        raise ValueError(
            "--speculative-draft-model-path goes with --speculative-algorithm STANDALONE or EAGLE3, and only there"
        )
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": drafts}
    if draft_model_path is not None:
        config["model"] = draft_model_path
    return config
