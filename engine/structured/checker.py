"""Verdicts on request grammars before they are admitted: does it parse, compile within the deadline, and
match some text? The server's gate (engine/server/grammar_gate.py) waits for one before a request reaches
the engine, so every grammar problem is a 400 and no hostile grammar reaches the engine's compiler.

Verdicts are cached by spec, so the same schema from a thousand requests is checked once and a refused
one is refused at once next time. Requests asking for the same grammar share its check; it is cancelled
when the last of them leaves (its client hung up) before it is done.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.structured.limits import GrammarLimits
from engine.structured.pool import GrammarPool, Job, PoolCounts
from engine.structured.spec import GrammarSpec, import_xgrammar

CACHE_SIZE = 1024  # verdicts kept (a spec and a None or a message each)


@dataclass(eq=False)
class _Entry:
    job: Job
    waiters: int = 0


class Ticket:
    """A request's wait for a verdict: future gets None (fine) or raises the error; release() when it no
    longer waits (done, or its client left), exactly once."""

    def __init__(self, checker: GrammarChecker, spec: GrammarSpec, entry: _Entry) -> None:
        self.future: Future[None] = entry.job.future
        self._checker = checker
        self._spec = spec
        self._entry: _Entry | None = entry

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._checker._release(self._spec, entry)


class GrammarChecker:
    def __init__(self, tokenizer_info_json: Callable[[], str], limits: GrammarLimits | None = None) -> None:
        """tokenizer_info_json: the model's vocabulary as xgrammar's serialized TokenizerInfo (tokenizer_info_json
        below), called once, when the processes start (start(), or the first check)."""
        self.limits = limits or GrammarLimits()
        self._tokenizer_info_json = tokenizer_info_json
        self._pool: GrammarPool | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, _Entry] = OrderedDict()

    def start(self) -> None:
        """Start the compiler processes now, in the background (the server does at start-up, where the model has
        a tokenizer): the first structured request then waits for its own check only, not for a fork server
        importing xgrammar and torch (seconds on a busy CPU)."""
        with self._lock:
            self._started_pool()

    def wait_started(self, timeout_s: float) -> bool:
        """After start(): wait until the compiler processes are up (False: not within timeout_s, or not started)."""
        pool = self._pool
        return pool is not None and pool.wait_started(timeout_s)

    def _started_pool(self) -> GrammarPool:
        if self._pool is None:
            self._pool = GrammarPool(self._tokenizer_info_json, self.limits.workers, self.limits.compile_timeout_s)
        return self._pool

    def check(self, spec: GrammarSpec) -> Ticket:
        """The verdict on spec, shared with every request that asks for the same one."""
        with self._lock:
            entry = self._cache.get(spec)
            if entry is None:
                entry = self._cache[spec] = _Entry(self._started_pool().submit(spec))
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)  # a pending one's waiters keep their entry (Ticket)
            else:
                self._cache.move_to_end(spec)
            entry.waiters += 1
        return Ticket(self, spec, entry)

    def counts(self) -> PoolCounts:
        return self._pool.counts if self._pool is not None else PoolCounts()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._cache.clear()
        if pool is not None:
            pool.close()

    def _release(self, spec: GrammarSpec, entry: _Entry) -> None:
        with self._lock:
            entry.waiters -= 1
            if entry.waiters > 0 or entry.job.future.done():
                return
            if self._cache.get(spec) is entry:
                del self._cache[spec]  # the next request for it starts a new check
            pool = self._pool
        if pool is not None:
            pool.cancel(entry.job)


def tokenizer_info_json(tokenizer: Any, vocab_size: int) -> str:
    """xgrammar's description of the vocabulary (which bytes each token spells), as the workers take it.
    Stop tokens are xgrammar's guess from the tokenizer: a check only asks whether some text matches."""
    xgr = import_xgrammar()
    return str(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size).serialize_json())
