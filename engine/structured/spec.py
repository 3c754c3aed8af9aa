"""What a request constrains its output to: a JSON schema, any JSON, a regex, an EBNF grammar or a
choice of strings. Plain data (it crosses the engine-process pipe); compiled by engine/structured/compiler.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.satisfiable import unsatisfiable_reason

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
JSON_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'


@dataclass(frozen=True)
class GrammarSpec:
    """kind: one of KINDS. text: the schema as JSON text, the regex, the EBNF (root rule `root`), or
    the choices as a JSON list; empty for json_object. Frozen and hashable: the compile cache's key."""

    kind: str
    text: str = ""
    any_whitespace: bool = (
        True  # JSON kinds: any whitespace between tokens (False: compact, vLLM's disable_any_whitespace)
    )

    @staticmethod
    def json_schema(schema: dict[str, Any] | str, any_whitespace: bool = True) -> GrammarSpec:
        # RecursionError: JSON nested deeper than Python's recursion limit (~1,000) is refused here, before the
        # nesting limit could name it (engine/structured/limits.py); it must not become a 500.
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from exc
            except RecursionError as exc:
                raise InvalidRequestError("the JSON schema nests too deep to be read") from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)  # key order kept: the properties' order
        except RecursionError as exc:
            raise InvalidRequestError("the JSON schema nests too deep to be read") from exc
        return GrammarSpec("json_schema", text, any_whitespace)

    @staticmethod
    def choice(options: list[str]) -> GrammarSpec:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError("a choice must be a non-empty list of non-empty strings")
        return GrammarSpec("choice", json.dumps(options))

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def schema(self) -> str:
        """The JSON schema of a JSON kind. JSON mode is OpenAI's: an object (xgrammar's built-in JSON
        grammar also allows a bare array or number), with any properties."""
        return self.text if self.kind == "json_schema" else JSON_OBJECT_SCHEMA

    def ebnf(self) -> str:
        """The grammar in xgrammar's EBNF, for the kinds that are not compiled from their own syntax."""
        if self.kind == "choice":
            # JSON string literals are EBNF string literals (the same escapes), so any text is safe here.
            return "root ::= " + " | ".join(json.dumps(option) for option in json.loads(self.text))
        return self.text

    def describe(self) -> str:
        return self.kind.replace("_", " ")


def parse_grammar(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar of a spec; InvalidRequestError if it does not parse."""
    xgr = import_xgrammar()
    try:
        if spec.is_json:
            return xgr.Grammar.from_json_schema(spec.schema(), any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(spec.ebnf())
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {spec.describe()}: {xgrammar_message(exc)}") from exc


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """The spec parsed and compiled by an xgrammar GrammarCompiler (against its vocabulary), refused if no text
    can ever match it: the one way both the engine (engine/structured/compiler.py) and the deadline's
    worker (engine/structured/worker.py) compile. InvalidRequestError naming the problem otherwise."""
    grammar = parse_grammar(spec)
    try:
        compiled = compiler.compile_grammar(grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {spec.describe()}: {xgrammar_message(exc)}") from exc
    reason = unsatisfiable_reason(compiled)
    if reason is not None:
        raise InvalidRequestError(f"the {spec.describe()} can never be matched: {reason}")
    return compiled


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # an install without it: the engine runs, only structured output is refused
        raise InvalidRequestError("structured output needs the xgrammar package (pip install xgrammar)") from exc
    return xgrammar


def xgrammar_message(exc: Exception) -> str:
    """xgrammar's C++ errors start with '[time] path/file.cc:line: '; the rest is the message."""
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()


_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+\.cc:\d+:\s*")
