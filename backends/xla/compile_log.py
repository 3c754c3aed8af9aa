"""JAX's own count of XLA compilations: its compile log (`jax_log_compiles`), counted by a log handler.

jax logs one "Compiling <name> ..." record (and "Finished XLA compilation of ... in N s") per program it
compiles; counting those records is the runtime's own answer to "did anything compile", independent of
the engine's bookkeeping. The programs' jit caches (XlaPrograms.cache_sizes) are the second counter.
"""

from __future__ import annotations

import logging
import threading

from backends.xla.vendor import load

# The JAX loggers that emit compile records (jax._src.interpreters.pxla, jax._src.dispatch).
_JAX_LOGGER = "jax"


class CompileCounter(logging.Handler):
    """Counts JAX's compile records by program name (every program the backend compiles, and any other)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self._lock_counts = threading.Lock()
        self.compiles: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            with self._lock_counts:
                self.compiles.append(message.split(" ", 2)[1])

    @property
    def count(self) -> int:
        return len(self.compiles)


_counter: CompileCounter | None = None


def compile_counter() -> CompileCounter:
    """The process's counter, installed on first use (jax_log_compiles on; the records stay out of the
    console: the backend logs its own line per compiled program)."""
    global _counter
    if _counter is None:
        jax = load().jax
        _counter = CompileCounter()
        jax_logger = logging.getLogger(_JAX_LOGGER)
        jax_logger.addHandler(_counter)
        # jax logs compiles at WARNING with jax_log_compiles: keep them off the root logger's console.
        jax_logger.propagate = False
        jax.config.update("jax_log_compiles", True)
    return _counter
