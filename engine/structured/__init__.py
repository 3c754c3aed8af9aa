"""Structured output: grammars (JSON schema, JSON, regex, EBNF, choice) that constrain sampling."""

from engine.structured.spec import GrammarSpec, validate_grammar

__all__ = ["GrammarSpec", "validate_grammar"]
