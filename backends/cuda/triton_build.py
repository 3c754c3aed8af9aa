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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

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


@functools.cache
def load_kernel(module_name: str, name: str) -> KernelHandle:
    """The kernel `name` of a module under backends/cuda/kernels/, imported on first use."""
    wait_for_runtime_warm_up()  # one driver: never two threads creating Triton's at once
    return KernelHandle(getattr(importlib.import_module(module_name), name))


_runtime_warm_up: threading.Thread | None = None


def import_ahead(modules: tuple[str, ...]) -> float:
    """Import `modules` (what a first compile would import on the main thread); returns the seconds taken.
    A module that fails to import is logged and skipped: whoever needs it imports it again and raises there."""
    started = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            logger.warning("%s not imported ahead (%s: %s)", name, type(exc).__name__, exc)
    return time.perf_counter() - started


def start_runtime_warm_up(also_import: tuple[str, ...] = ()) -> None:
    """Ready Triton's runtime in a thread while the model loads: its driver, whose C utilities gcc compiles
    on a cold cache, and the hash of its own sources that every kernel's cache key starts with (~1.3 s
    together of a cold capture's main thread, on the H200); then import `also_import` (inductor's compiler:
    seconds of imports the first compile would make on the main thread). One thread for both, so no two
    warm-up threads import the same packages at once. Idempotent; nothing under the interpreter."""
    global _runtime_warm_up
    if _runtime_warm_up is not None or interpreted():
        return

    def warm_up() -> None:
        started = time.perf_counter()
        try:
            from triton.runtime import driver
            from triton.runtime.cache import triton_key

            driver.active.get_current_target()
            triton_key()
        except Exception as exc:
            logger.warning("Triton runtime not readied ahead (%s: %s)", type(exc).__name__, exc)
        else:
            logger.info(
                "Triton runtime ready (driver and cache key) in %.2f s, in the background",
                time.perf_counter() - started,
            )
        if also_import:
            seconds = import_ahead(also_import)
            logger.info("compiler modules imported in %.2f s, in the background (%s)", seconds, ", ".join(also_import))

    _runtime_warm_up = threading.Thread(target=warm_up, name="triton-runtime-warm-up", daemon=True)
    _runtime_warm_up.start()


def wait_for_runtime_warm_up() -> None:
    """Join the warm-up thread: before this thread creates Triton's driver, or imports what it imports."""
    if _runtime_warm_up is not None:
        _runtime_warm_up.join()


def build_launcher(kernel: Any) -> None:
    """Compile a compiled kernel's C launcher (gcc, ~0.2-0.5 s on a cold cache, one per kernel signature)
    into Triton's cache. Triton builds it at the kernel's first launch, on the launching thread; built
    here by a compile worker, that launch only loads it."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as exc:
        logger.debug("launcher of %s not built ahead: %s", getattr(kernel, "name", kernel), exc)


def _compile_with_launcher(compile_fn: Any) -> Any:
    kernel = compile_fn()
    build_launcher(kernel)
    return kernel


class _LauncherBuildingExecutor:
    """The executor Triton's AsyncCompileMode submits compiles to: each compile, then its launcher."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def submit(self, compile_fn: Any) -> Any:
        return self.executor.submit(_compile_with_launcher, compile_fn)


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
    rest and must come before a CUDA graph is captured. Each worker also builds its kernel's C launcher
    (build_launcher), which Triton would build at the first launch, on the main thread. Without
    AsyncCompileMode (Triton < 3.4), or under the interpreter, nothing is started and kernels compile at
    their first launch as before.
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

        wait_for_runtime_warm_up()
        self._executor = ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1), thread_name_prefix="triton-compile")
        # ignore_errors: a kernel that fails here is compiled again at its launch, which raises there.
        self._mode = AsyncCompileMode(_LauncherBuildingExecutor(self._executor), ignore_errors=True)
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
