"""Grammars compiled off the engine's step loop, cached by spec.

xgrammar compiles a grammar against the tokenizer's vocabulary (which tokens can follow which
grammar state: the expensive part, milliseconds for a small schema, seconds for a big one). A few
worker threads do it (xgrammar releases the GIL while it works), so a step never waits for a compile,
a request waits only for its own grammar, and one big grammar does not hold up the others; the same
schema from a thousand requests compiles once. A queued compile that no request waits for any more
(all were aborted) is dropped.

Behind `engine serve` every grammar reaching this compiler has already compiled within the deadline in
a compiler process (engine/structured/checker.py), so these compiles are bounded; the Python API
trusts its caller and has no deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.structured.spec import GrammarSpec, compile_spec, import_xgrammar

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (a compiled JSON schema is tens of KB to tens of MB) ...
CACHE_BYTES = 1 << 30  # ... and at most this much of them (xgrammar's own count of each one's memory)
COMPILE_THREADS = 4  # grammars compiled at once
NICE = 10  # compile threads yield the CPU to the step loop (Linux: a thread's own nice value)


class GrammarCompiler:
    """submit(spec) -> Future of a CompiledSpec (InvalidRequestError if it fails); release(spec) once per
    submit when the request no longer waits for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 1) -> None:
        """threads: xgrammar's own threads for one compile."""
        import_xgrammar()  # fail now, not in the worker, when xgrammar is missing
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.threads = threads
        self._compiler: Any = None  # made by the first compile: preparing the vocabulary takes 0.1-0.5 s
        self._prepare_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=COMPILE_THREADS, thread_name_prefix="grammar", initializer=_lower_priority
        )
        self._lock = threading.RLock()  # re-entered: cancelling a future under it runs its done callback
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._bytes: dict[Future[Any], int] = {}  # memory of each compiled grammar in the cache
        self._waiters: dict[GrammarSpec, int] = {}
        # Bitmasks of the tokens a JSON text may contain raw, with and without \t \n \r (see json_guard).
        self._json_safe: dict[bool, torch.Tensor] = {}

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        with self._lock:
            future = self._cache.get(spec)
            if future is None or future.cancelled():
                future = self._pool.submit(self._compile, spec)
                future.add_done_callback(self._compiled)
                self._cache[spec] = future
            else:
                self._cache.move_to_end(spec)
            self._waiters[spec] = self._waiters.get(spec, 0) + 1
        self._trim()
        return future

    def release(self, spec: GrammarSpec) -> None:
        """One request stopped waiting for spec; the last one cancels its compile if it has not started."""
        with self._lock:
            left = self._waiters.get(spec, 0) - 1
            if left > 0:
                self._waiters[spec] = left
                return
            self._waiters.pop(spec, None)
            future = self._cache.get(spec)
            if future is not None and future.cancel():
                del self._cache[spec]
                self._bytes.pop(future, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiled(self, future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            with self._lock:
                if any(cached is future for cached in self._cache.values()):  # not trimmed already
                    self._bytes[future] = int(future.result().grammar.memory_size_bytes)
        self._trim()

    def _trim(self) -> None:
        """Oldest first, drop finished grammars beyond CACHE_SIZE or CACHE_BYTES (a request that waits has its
        future already)."""
        with self._lock:
            total = sum(self._bytes.values())
            for spec, future in list(self._cache.items()):
                if len(self._cache) <= CACHE_SIZE and total <= CACHE_BYTES:
                    break
                if future.done():
                    del self._cache[spec]
                    total -= self._bytes.pop(future, 0)

    def _prepare(self) -> Any:
        with self._prepare_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                start = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._json_safe = {
                    whitespace: _safe_tokens(info.decoded_vocab, self.vocab_size, whitespace)
                    for whitespace in (True, False)
                }
                # xgrammar's own cache is off: it has no bound by default, and this class caches by spec.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
                logger.info(
                    "structured output: xgrammar %s over a %d-token vocabulary (%s, stop tokens %s), prepared in "
                    "%.2f s",
                    _version(),
                    self.vocab_size,
                    info.vocab_type.name.lower(),
                    self.stop_token_ids,
                    time.perf_counter() - start,
                )
            return self._compiler

    def _compile(self, spec: GrammarSpec) -> CompiledSpec:
        compiler = self._prepare()
        start = time.perf_counter()
        compiled = compile_spec(compiler, spec)
        elapsed = time.perf_counter() - start
        (logger.info if elapsed > 0.5 else logger.debug)("compiled a %s grammar in %.3f s", spec.describe(), elapsed)
        return CompiledSpec(compiled, self._json_safe[spec.any_whitespace] if spec.is_json else None)


def _lower_priority() -> None:
    """Runs on each compile thread: on Linux a thread's nice value is its own (setpriority of its id)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


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
