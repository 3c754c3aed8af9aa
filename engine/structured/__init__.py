"""Structured output: grammars (JSON schema, JSON, regex, EBNF, choice) that constrain sampling."""

from engine.structured.limits import GrammarLimits, validate_grammar
from engine.structured.spec import GrammarSpec

__all__ = ["GrammarLimits", "GrammarSpec", "validate_grammar"]
