"""Incremental detokenization: each step decodes a short window, not the whole output.

Decoding every output token again at every step costs O(n) per token, O(n^2) per
request: at a few thousand tokens that is milliseconds per request per step. As
vLLM does, decode only from `prefix_offset` (a few tokens back, so tokenizers
that drop a leading space at the start of a decode still see it in context):
the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]). Text that
ends in U+FFFD (a character whose bytes continue in the next token) is held back
until it completes; `flush` decodes the whole output once when a request ends.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0  # first token of the decode window
        self.read_offset = 0  # tokens whose text has been emitted

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def step(self, token_ids: list[int]) -> str:
        """The text the newest tokens add (empty while a character is still incomplete)."""
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(token_ids[self.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return window_text[len(prefix_text) :]

    def flush(self, token_ids: list[int]) -> str:
        """The whole text, decoded once (includes anything held back at the end)."""
        return self._decode(token_ids)
