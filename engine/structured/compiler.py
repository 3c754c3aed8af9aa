"""Grammars compiled off the engine's step loop, cached by spec.

xgrammar compiles a grammar against the tokenizer's vocabulary (which tokens can follow which
grammar state: the expensive part, milliseconds for a small schema, seconds for a big one). One
worker thread does it, so a step never waits for a compile and a request waits only for its own
grammar; the same schema from a thousand requests compiles once.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec, import_xgrammar, xgrammar_message

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (a compiled JSON schema is tens of KB to a few MB)


class GrammarCompiler:
    """submit(spec) -> Future of an xgrammar CompiledGrammar (InvalidRequestError if it fails)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 1) -> None:
        import_xgrammar()  # fail now, not in the worker, when xgrammar is missing
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.threads = threads
        self._compiler: Any = None  # made in the worker: preparing the vocabulary takes 0.1-0.5 s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        # Bitmasks of the tokens a JSON text may contain raw, with and without \t \n \r (see json_guard).
        self._json_safe: dict[bool, torch.Tensor] = {}

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        future = self._cache.get(spec)
        if future is None:
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        xgr = import_xgrammar()
        if self._compiler is None:
            start = time.perf_counter()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            self._json_safe = {
                whitespace: _safe_tokens(info.decoded_vocab, self.vocab_size, whitespace)
                for whitespace in (True, False)
            }
            logger.info(
                "structured output: xgrammar %s over a %d-token vocabulary (%s, stop tokens %s), prepared in %.2f s",
                _version(),
                self.vocab_size,
                info.vocab_type.name.lower(),
                self.stop_token_ids,
                time.perf_counter() - start,
            )
        start = time.perf_counter()
        try:
            if spec.is_json:
                compiled = self._compiler.compile_json_schema(spec.schema(), any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.text)
            else:
                compiled = self._compiler.compile_grammar(spec.ebnf())
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {spec.describe()}: {xgrammar_message(exc)}") from exc
        elapsed = time.perf_counter() - start
        (logger.info if elapsed > 0.5 else logger.debug)("compiled a %s grammar in %.3f s", spec.describe(), elapsed)
        return CompiledSpec(compiled, self._json_safe[spec.any_whitespace] if spec.is_json else None)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xgrammar")
    except PackageNotFoundError:
        return "(unknown version)"


@dataclass(frozen=True)
class CompiledSpec:
    """xgrammar's compiled grammar, and for JSON the bitmask every mask is ANDed with (json_guard)."""

    grammar: Any
    json_guard: torch.Tensor | None


def _safe_tokens(decoded_vocab: list[bytes], vocab_size: int, whitespace: bool) -> torch.Tensor:
    """int32 bitmask [ceil(vocab / 32)] of the tokens without a byte JSON never has raw.

    Why: xgrammar 0.2.9 compiles a length-bounded JSON string ({"type": "string", "maxLength": 6})
    to the characters [^"\\\r\n], which lets a raw control character into the string (seen: a
    random model wrote U+0017 there, and json.loads refused the output). Control bytes other than
    tab, newline and return are invalid anywhere in JSON; those three only as whitespace between
    tokens, so a compact grammar (any_whitespace False) forbids them too.
    """
    allowed_controls = {9, 10, 13} if whitespace else set()
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    for token, piece in enumerate(decoded_vocab[:vocab_size]):
        if not any(byte < 32 and byte not in allowed_controls for byte in piece):
            words[token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def new_matcher(compiled: CompiledSpec) -> Any:
    """A request's own matcher: its position in the grammar, advanced by each token it is given."""
    return import_xgrammar().GrammarMatcher(compiled.grammar)
