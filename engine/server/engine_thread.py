"""The one thread that runs the engine in the server: it builds the engine, then runs its loop.

Why one thread for both: torch's CPU kernels run on OpenMP, and libgomp gives
every thread that opens a parallel region its own team of workers. Build the
engine on the main thread (weight packing, compilation, the warm-up request)
and step it on another, and the process holds two teams; once OpenMP threads
outnumber the cores, libgomp stops letting idle workers spin and puts them to
sleep after every region, so each of the hundreds of small parallel regions in
a step pays a futex wake-up. On a 2-core machine that made every prefill in the
server 1.6x slower than the same prefill in-process (1.0x once the engine was
built on the thread that steps it), and a request's throughput through the
server 0.62 of in-process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class EngineThread(threading.Thread):
    """Runs submitted calls in order; the server's engine is built by `call` and stepped by `run_loop`."""

    def __init__(self, name: str = "engine-loop") -> None:
        super().__init__(name=name, daemon=True)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, result = job
            try:
                result.set_result(fn())
            except BaseException as exc:
                result.set_exception(exc)

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on this thread, waited for; its exception is raised here."""
        if not self.is_alive():
            self.start()
        result: Future = Future()
        self._jobs.put((fn, result))
        return result.result()

    def run_loop(self, loop: Callable[[], None]) -> None:
        """Hand the thread over to `loop` for good: the thread ends when it returns."""
        if not self.is_alive():
            self.start()
        self._jobs.put((loop, Future()))
        self._jobs.put(None)
