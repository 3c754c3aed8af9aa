"""Loading Triton kernels lazily, and knowing whether they run compiled or interpreted.

Kernel sources live in backends/cuda/kernels/, as module-level functions
(Triton resolves the helpers a kernel calls among its module's globals), and
are imported only on first use, so `import backends` needs no Triton.
With TRITON_INTERPRET=1 (the CPU tests, set before triton is imported) the
same source runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

logger = logging.getLogger(__name__)

# Inside compile_only(): a launch compiles its kernel variant (Triton's warmup) and runs nothing.
_COMPILE_ONLY: ContextVar[bool] = ContextVar("engine_triton_compile_only", default=False)


def interpreted() -> bool:
    """Kernels run in Triton's interpreter (CPU tests), not compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class KernelHandle:
    """A Triton kernel launched as `kernel[grid](*args, **kwargs)`; under `compile_only()` the same call
    compiles the variant those arguments select (Triton's warmup) without launching it. Launchers stay
    the one place that knows a kernel's arguments, for running and for compiling ahead alike."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        if _COMPILE_ONLY.get():
            return functools.partial(self.fn.warmup, grid=grid)
        return self.fn[grid]  # the launch itself: nothing added to an eager step's launches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


@functools.lru_cache(maxsize=None)
def load_kernel(module_name: str, name: str) -> KernelHandle:
    """The kernel `name` of a module under backends/cuda/kernels/, imported on first use."""
    return KernelHandle(getattr(importlib.import_module(module_name), name))


@contextmanager
def compile_only() -> Iterator[None]:
    """Launches inside compile their kernels and run nothing (the tensors they get are only read for
    dtypes, alignment and strides; torch ops around them still run)."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


class BackgroundCompiles:
    """Triton compiles in worker threads (Triton's AsyncCompileMode) from construction to `finish()`.

    Launches made meanwhile in compile_only() submit their kernels to the workers and return at once;
    a real launch of a kernel still compiling waits for it. Compiling runs mostly outside the GIL
    (MLIR, LLVM, ptxas), so the engine's kernels compile while dynamo and inductor compile the step on
    the main thread: each took 1-2 s of a cold capture, one after another. `finish()` waits for the
    rest and must come before a CUDA graph is captured. Without AsyncCompileMode (Triton < 3.4),
    or under the interpreter, nothing is started and kernels compile at their first launch as before.
    """

    def __init__(self, workers: int | None = None) -> None:
        self._mode: Any = None
        self._executor: Any = None
        if interpreted():
            return
        try:
            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:
            return
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1), thread_name_prefix="triton-compile")
        # ignore_errors: a kernel that fails here is compiled again at its launch, which raises there.
        self._mode = AsyncCompileMode(self._executor, ignore_errors=True)
        self._mode.__enter__()

    @property
    def active(self) -> bool:
        return self._mode is not None

    def finish(self) -> None:
        """Wait for every submitted compile and make the kernels launchable; idempotent."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            self._executor.shutdown(wait=True)
