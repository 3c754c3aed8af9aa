"""Every request field is honoured or refused: what a body may carry beyond the fields we implement.

A client that asks for JSON output, tools or a logit bias and gets a 200 with free text is worse
off than one told "400: response_format is not supported". So fields the protocol models do not
declare are sorted three ways:

- harmless OpenAI metadata that changes nothing about generation (`user`, `metadata`, `store`, ...):
  accepted and ignored;
- structured output (`response_format`, `structured_outputs`, `guided_*`, `regex`, ...): read by
  engine/server/structured_fields.py, which refuses what it cannot honour;
- features this server does not implement yet (the legacy `functions`, `best_of` > 1, beam
  search, ...): a 400 naming the field, unless the value asks for nothing (`functions: []`, `best_of: 1`);
- anything else: a 400 naming it as unknown, unless the server runs with
  `--allow-unknown-fields` (for clients that send extras of their own), which ignores them.

The same holds inside chat messages (`function_call`, `audio`, ... are refused: dropping them would
change what the model is asked). Tools and tool calls are engine/server/tools.py's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from engine.server.errors import APIError
from engine.server.structured_fields import STRUCTURED_FIELDS

# Top-level fields that carry no generation semantics.
HARMLESS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "logprobs_mode",
    }
)

# Fields of features not implemented here, and the values that ask for nothing (accepted).
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": ([], None),
    "function_call": ("none", None),
    "bad_words": ([], None),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (["text"], None),
    "web_search_options": (None,),
    "best_of": (1, None),
    "use_beam_search": (False, None),
    "length_penalty": (1.0, 1, None),
    "truncate_prompt_tokens": (None,),
    "priority": (0, None),
}

# Inside a chat message: fields whose history is not rendered.
MESSAGE_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
    "reasoning_content": (None,),
}

WHY = {
    "functions": "the legacy functions field is not supported; send tools",
    "function_call": "the legacy function_call field is not supported; send tool_choice",
}


def check_request_fields(request: BaseModel, allow_unknown: bool) -> None:
    """Raise a 400 APIError for the first field `request` cannot honour (see the module docstring)."""
    _check(request.model_extra or {}, NOT_IMPLEMENTED, HARMLESS | STRUCTURED_FIELDS, allow_unknown, "")
    for index, message in enumerate(getattr(request, "messages", None) or []):
        _check(message.model_extra or {}, MESSAGE_NOT_IMPLEMENTED, frozenset(), allow_unknown, f"messages[{index}].")


def _check(
    extra: dict[str, Any],
    refused: dict[str, tuple[Any, ...]],
    harmless: frozenset[str],
    allow_unknown: bool,
    prefix: str,
) -> None:
    for field, value in extra.items():
        name = prefix + field
        if field in harmless:
            continue
        if field in refused:
            if any(value == accepted and type(value) is type(accepted) for accepted in refused[field]):
                continue  # the value asks for nothing (same type, so `true` is not 1)
            why = WHY.get(field, f"{field} is not supported by this server")
            raise APIError(f"{name}: {why}", param=name)
        if not allow_unknown:
            raise APIError(
                f"{name}: unknown field (this server refuses fields it does not implement; start it with "
                "--allow-unknown-fields to ignore extras)",
                param=name,
            )
