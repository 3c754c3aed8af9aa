"""Requests waiting for their grammar to compile, outside the scheduler until it has.

A request with a grammar is not scheduled before its matcher exists (its first sampled token
already needs the mask), but it does not hold anyone else up: the compile runs in the compiler's
threads, and each engine step takes whichever grammars have finished since the last one. A request
aborted while it waits releases its compile, which is dropped if no other request waits for it.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from engine.errors import InvalidRequestError
from engine.request import Request
from engine.structured.compiler import GrammarCompiler, new_matcher

IDLE_WAIT_S = 0.05  # an engine with nothing else to do sleeps this long at most for a compile


class GrammarWaitlist:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: GrammarCompiler | None = None  # made on the first grammar: xgrammar is imported then
        self._waiting: dict[str, tuple[Request, Future[Any]]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: Request) -> None:
        spec = request.params.grammar
        assert spec is not None
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs the model's tokenizer, and this model has none")
        if self._compiler is None:
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))  # xgrammar's own threads, for big grammars
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.stop_token_ids), threads)
        self._waiting[request.request_id] = (request, self._compiler.submit(spec))

    def remove(self, request_id: str) -> Request | None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return None
        self._release(entry[0])
        return entry[0]

    def take_ready(self, idle: bool) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """(requests whose matcher is ready, requests whose grammar failed with the error).
        idle: nothing else can run, so wait up to IDLE_WAIT_S for a compile rather than spin."""
        if not self._waiting:
            return [], []
        if idle:
            wait([future for _, future in self._waiting.values()], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        ready: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        for request_id, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[request_id]
            self._release(request)
            error = future.exception()
            if error is None:
                request.grammar = new_matcher(future.result())
                request.grammar_guard = future.result().json_guard
                ready.append(request)
            else:
                failed.append((request, error))
        return ready, failed

    def _release(self, request: Request) -> None:
        assert self._compiler is not None and request.params.grammar is not None
        self._compiler.release(request.params.grammar)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
