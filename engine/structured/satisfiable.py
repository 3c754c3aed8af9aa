"""Whether any text can match a compiled grammar, so that one that never can is a 400, not a 500.

A grammar with no text (the regex `[^\\s\\S]`, a JSON schema whose string `pattern` is that, an EBNF rule
of a class that excludes every character) parses and compiles: xgrammar sees a character class, not
that the class is empty. At run time its mask then forbids every token, the sampler takes the argmax
of a row of -inf, the grammar refuses that token and the request fails in the middle of generation.

Two checks after the compile, both cheap next to it:
- no character class in the compiled grammar (xgrammar's printed EBNF, after its own normalization) may
  be empty, unless starred (zero repetitions always match). This also refuses a grammar that matches
  some texts but has an empty class on another branch (`x|y[^\\s\\S]`): a model that writes the `y`
  would meet the same dead end;
- at least one token may begin a text (a vocabulary that cannot spell what the grammar wants).
A dead end that neither catches (an empty class is the only way xgrammar's grammars get one that we
know of) still fails its request alone, as before.
"""

from __future__ import annotations

import re
from typing import Any

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # never a character of UTF-8 text: a class of only these matches nothing


def unsatisfiable_reason(compiled: Any) -> str | None:
    """Why no text can match the compiled grammar (xgrammar's CompiledGrammar), or None."""
    text = str(compiled.grammar)
    # A starred class (xgrammar's `[...]*`) may match zero times: empty, it is no dead end.
    classes = (m for m in _CLASSES.finditer(text) if m.group().startswith("[") and text[m.end() : m.end() + 1] != "*")
    if any(_class_is_empty(bool(m.group(1)), m.group(2)) for m in classes):
        return "a character class in it matches no character"
    if not _some_token_can_begin(compiled):
        return "no token of the vocabulary can begin a text that matches it"
    return None


def _some_token_can_begin(compiled: Any) -> bool:
    import xgrammar as xgr  # present: the grammar was compiled with it

    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _class_is_empty(negated: bool, body: str) -> bool:
    """A class of xgrammar's printed EBNF, `[` negated body `]`: True if no character matches it."""
    ranges = [(low, high) for low, high in _ranges(body) if low <= high]
    if not negated:
        return all(SURROGATES[0] <= low and high <= SURROGATES[1] for low, high in ranges)
    covered_to = -1  # code points 0..covered_to are all excluded by the negated ranges seen so far
    for low, high in sorted([*ranges, SURROGATES]):
        if low > covered_to + 1:
            return False  # covered_to + 1 .. low - 1 is a gap: the negated class matches it
        covered_to = max(covered_to, high)
    return covered_to >= MAX_CODEPOINT


def _ranges(body: str) -> list[tuple[int, int]]:
    """The (low, high) code point ranges of a class body: single characters and `a-b` ranges, escapes as
    xgrammar prints them (\\n, \\0, \\xHH, \\uHHHH, \\UHHHHHHHH, \\] and \\-)."""
    items = _CLASS_ITEMS.findall(body)
    ranges = []
    i = 0
    while i < len(items):
        low = _code_point(items[i])
        if i + 2 < len(items) and items[i + 1] == "-":
            ranges.append((low, _code_point(items[i + 2])))
            i += 3
        else:
            ranges.append((low, low))
            i += 1
    return ranges


def _code_point(item: str) -> int:
    if len(item) == 1:
        return ord(item)
    letter = item[1]
    if letter in "xuU" and len(item) > 2:
        return int(item[2:], 16)
    return _ESCAPES.get(letter, ord(letter))


_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}
# String literals are matched (and skipped) so that a `[` inside one is not taken for a class.
_CLASSES = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[(\^?)([^\]\\]*(?:\\.[^\]\\]*)*)\]', re.DOTALL)
_CLASS_ITEMS = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", re.DOTALL)
