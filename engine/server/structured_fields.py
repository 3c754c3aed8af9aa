"""The request fields that ask for structured output, in the spellings clients send, as one GrammarSpec.

- OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
  ({"type": "text"} asks for nothing);
- vLLM: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object": ...} and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with `guided_decoding_backend`);
- SGLang: `json_schema` (a schema as JSON text), `regex`, `ebnf`.

At most one constraint per request; anything this server cannot honour (a structural tag, a
whitespace pattern, another backend) is a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from pydantic import BaseModel

from engine.errors import InvalidRequestError
from engine.server.errors import APIError
from engine.structured.limits import GrammarLimits, validate_grammar
from engine.structured.spec import GrammarSpec

# Top-level fields read here (engine/server/fields.py leaves them to this module).
STRUCTURED_FIELDS = frozenset(
    {
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "json_schema",
        "regex",
        "ebnf",
    }
)
BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values honoured: this server runs xgrammar
STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
STRUCTURED_OUTPUTS_NEUTRAL = {
    "backend": BACKENDS,
    "disable_any_whitespace": (None, False, True),
    "disable_additional_properties": (None, False),
    "disable_fallback": (None, False, True),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


class AskedGrammar(NamedTuple):
    """The constraint a request asks for, and the field that asked (named by every error about it)."""

    spec: GrammarSpec
    field: str


def grammar_from_request(request: BaseModel, limits: GrammarLimits) -> AskedGrammar | None:
    """The one constraint the request asks for, within the size and nesting limits, or None; APIError (400)
    naming the field otherwise. Not parsed here: that runs in a compiler process under the deadline
    (engine/server/grammar_gate.py). Off the event loop (the tokenizer thread): a megabyte schema takes
    milliseconds to serialize and scan."""
    extra: dict[str, Any] = request.model_extra or {}
    found: list[AskedGrammar] = []
    for field in sorted(STRUCTURED_FIELDS & extra.keys()):
        value = extra[field]
        try:
            spec = _spec_of(field, value)
            if spec is not None:
                validate_grammar(spec, limits)
                check_schema_refs(spec)
        except InvalidRequestError as exc:
            raise APIError(f"{field}: {exc}", param=field) from exc
        if spec is not None:
            found.append(AskedGrammar(spec, field))
    if len(found) > 1:
        names = ", ".join(asked.field for asked in found)
        raise APIError(
            f"at most one structured-output constraint per request; this one has {names}", param=found[1].field
        )
    return found[0] if found else None


# A "$ref" key with a string value in the schema's JSON text (json.dumps escapes a quote inside a string, so a
# description that mentions "$ref" never matches).
_REF = re.compile(r'(?<!\\)"\$ref": "((?:[^"\\]|\\.)*)"')


def check_schema_refs(spec: GrammarSpec) -> None:
    """Only references within the schema ("#/$defs/..."): xgrammar fetches nothing, and took a `$ref` to
    `http://...` or `file:///...` for "any JSON", a constraint silently dropped (issue #48)."""
    if not spec.is_json:
        return
    for match in _REF.finditer(spec.text):
        if not match.group(1).startswith("#"):
            raise InvalidRequestError(
                f"the JSON schema's $ref {match.group(1)[:100]!r} points outside the schema; only references "
                'within it ("#/$defs/...") are supported'
            )


def _spec_of(field: str, value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if field == "response_format":
        return _response_format(value)
    if field == "structured_outputs":
        return _structured_outputs(value)
    if field == "guided_decoding_backend":
        if value not in BACKENDS:
            raise InvalidRequestError(f"this server's structured-output backend is xgrammar, not {value!r}")
        return None
    if field == "guided_whitespace_pattern":
        raise InvalidRequestError("a whitespace pattern is not supported (xgrammar's JSON allows any whitespace)")
    if field in ("guided_json", "json_schema"):
        return GrammarSpec.json_schema(value)
    if field == "guided_choice":
        return GrammarSpec.choice(value)
    if field in ("guided_regex", "regex"):
        return GrammarSpec("regex", _text(value, "a regex"))
    return GrammarSpec("ebnf", _text(value, "an EBNF grammar"))  # guided_grammar, ebnf


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError('must be an object with a "type" ("text", "json_object" or "json_schema")')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequestError('type "json_schema" needs a "json_schema" object holding the "schema"')
        schema = inner.get("schema", inner.get("json_schema"))  # some clients nest the name's schema once more
        if schema is None:
            raise InvalidRequestError('json_schema has no "schema"')
        return GrammarSpec.json_schema(schema)
    raise InvalidRequestError(f'type {kind!r} is not supported (use "text", "json_object" or "json_schema")')


def _structured_outputs(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict):
        raise InvalidRequestError("must be an object")
    unknown = sorted(set(value) - STRUCTURED_OUTPUTS_KEYS - set(STRUCTURED_OUTPUTS_NEUTRAL))
    if unknown:
        raise InvalidRequestError(f"unknown key {unknown[0]!r}")
    for key, neutral in STRUCTURED_OUTPUTS_NEUTRAL.items():
        if key in value and value[key] not in neutral:
            raise InvalidRequestError(f"{key}={value[key]!r} is not supported")
    asked = [key for key in sorted(STRUCTURED_OUTPUTS_KEYS) if value.get(key) not in (None, False)]
    if len(asked) > 1:
        raise InvalidRequestError(
            f"at most one of {', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))}; got {', '.join(asked)}"
        )
    if not asked:
        return None
    key = asked[0]
    any_whitespace = not value.get("disable_any_whitespace")
    if key == "json":
        return GrammarSpec.json_schema(value[key], any_whitespace)
    if key == "json_object":
        return GrammarSpec("json_object", any_whitespace=any_whitespace)
    if key == "choice":
        return GrammarSpec.choice(value[key])
    if key == "regex":
        return GrammarSpec("regex", _text(value[key], "a regex"))
    return GrammarSpec("ebnf", _text(value[key], "an EBNF grammar"))


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"must be {what} as a non-empty string")
    return value
