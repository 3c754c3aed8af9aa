"""What a request's grammar may cost, checked before anything parses or compiles it.

Size and nesting are read off the spec's text with one linear scan: a 25 KB schema of arrays nested 900
deep took xgrammar 73 s to parse and compile (issue #48), and parse time grows faster than cubically with
depth, so depth is refused here, in microseconds, rather than measured by a parse. What the scan cannot
see (a wide schema, a counted repetition such as `[a-z]{1,50000}`) is bounded by the compile deadline
(engine/structured/pool.py), which these limits travel with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate

from engine.errors import InvalidRequestError
from engine.structured.spec import KINDS, GrammarSpec

# Defaults of `engine serve --grammar-max-chars/--grammar-max-depth/--grammar-compile-timeout/--grammar-workers`.
DEFAULT_MAX_CHARS = 1 << 20  # a schema, regex or grammar of more than a megabyte is refused before parsing
# JSON nesting of the schema document (an object property is two levels: "properties", then its schema),
# parentheses of a regex or EBNF. OpenAI allows 10 levels of schema nesting; 64 is ~30, and a 64-deep
# schema parses in ~20 ms where 300 deep took 1.2 s.
DEFAULT_MAX_DEPTH = 64
# CPU seconds a grammar's parse and compile may take (vLLM bounds a regex compile by 5 s as well); a wide
# schema of 800 properties takes ~1.4 s on one core, so legitimate big schemas fit with room.
DEFAULT_COMPILE_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 4  # compiler processes: one slow grammar leaves three for the others (they run at nice +10)


@dataclass(frozen=True)
class GrammarLimits:
    """The operator's bounds on request grammars (flags of `engine serve`, docs/structured_output.md)."""

    max_chars: int = DEFAULT_MAX_CHARS
    max_depth: int = DEFAULT_MAX_DEPTH
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    workers: int = DEFAULT_WORKERS

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_depth", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"grammar {name} must be >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"grammar compile_timeout_s must be > 0, got {self.compile_timeout_s}")


def validate_grammar(spec: GrammarSpec, limits: GrammarLimits | None = None) -> None:
    """A known kind within the size and nesting limits, or one InvalidRequestError naming the limit.

    No parse: that runs in a compiler process under the deadline (engine/structured/checker.py)."""
    limits = limits or GrammarLimits()
    if spec.kind not in KINDS:
        raise InvalidRequestError(f"unknown structured-output kind {spec.kind!r} (one of {', '.join(KINDS)})")
    if len(spec.text) > limits.max_chars:
        raise InvalidRequestError(
            f"the {spec.describe()} has {len(spec.text):,} characters; at most {limits.max_chars:,} "
            "(--grammar-max-chars)"
        )
    depth = nesting_depth(spec)
    if depth > limits.max_depth:
        raise InvalidRequestError(
            f"the {spec.describe()} nests {depth:,} levels deep; at most {limits.max_depth} (--grammar-max-depth)"
        )


def nesting_depth(spec: GrammarSpec) -> int:
    """How deep the spec's text nests: JSON containers for a schema or a choice list, parentheses for a
    regex or an EBNF grammar (outside string literals, character classes, escapes and comments)."""
    if spec.kind in ("json_schema", "choice"):
        return _depth(_JSON_TOKENS.findall(spec.text), {"[", "{"}, {"]", "}"})
    if spec.kind == "regex":
        return _depth(_REGEX_TOKENS.findall(spec.text), {"("}, {")"})
    if spec.kind == "ebnf":
        return _depth(_EBNF_TOKENS.findall(spec.text), {"("}, {")"})
    return 0


def _depth(tokens: list[str], opening: set[str], closing: set[str]) -> int:
    """The deepest running count of openings minus closings; other tokens (strings, classes) count 0."""
    steps = (1 if token in opening else -1 if token in closing else 0 for token in tokens)
    return max(accumulate(steps, initial=0))


# Each pattern matches a whole string literal, class, escape or comment (so brackets inside them are not
# counted), or one bracket. The literals are written unrolled ("[^"\\]*(?:\\.[^"\\]*)*"): linear, no
# backtracking, whatever the text.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_REGEX_TOKENS = re.compile(r"\\.|\[\^?\]?[^\]\\]*(?:\\.[^\]\\]*)*\]|[()]", re.DOTALL)
_EBNF_TOKENS = re.compile(
    r'"[^"\\]*(?:\\.[^"\\]*)*"|\'[^\'\\]*(?:\\.[^\'\\]*)*\'|\[[^\]\\]*(?:\\.[^\]\\]*)*\]|#[^\n]*|[()]', re.DOTALL
)
