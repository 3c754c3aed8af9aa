"""Compiler processes that run request grammars under a deadline, and are killed at it.

Why processes: xgrammar parses and compiles in C++ calls that nothing can interrupt from Python, so a
thread given a hostile schema runs until xgrammar is done (73 s for issue #48's 900-deep arrays; a
99 KB schema of 2,000 properties takes 28 s). A process can be killed. Each worker is forked from
multiprocessing's fork server, where xgrammar is already imported (engine/structured/worker.py), so a
replacement is ready in milliseconds, and it runs at nice +10. A check past DEMOTE_AFTER_S of CPU drops to
nice +19 (its worker is replaced when it is done), so a small grammar arriving while big ones compile is
checked first.

The deadline is CPU time (read from /proc; wall time elsewhere): "too complex" is then a property of
the grammar, not of how busy the box is, and a legitimate schema is not refused because the engine was
decoding beside it. A worker starved of CPU is still killed at WALL_FACTOR times the deadline.

A job's waiters can all leave (their clients hung up): cancel() drops a queued job, and a running one's
worker is killed and replaced, so work for nobody stops at once (issue #48, item 2).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often a slot looks at its worker's CPU time and its job's waiters
WALL_FACTOR = 4  # a worker starved of CPU is still killed at this many times the deadline (+ WALL_GRACE_S)
WALL_GRACE_S = 5.0
START_TIMEOUT_S = 120.0  # the first worker waits for the fork server to import xgrammar and torch
RESTART_PAUSE_S = 1.0  # after a worker failed to start, before the next try
SPAWN_WAIT_S = 10.0  # close() waits this long at most for a worker's spawn under way
WORKER_MODULE = "engine.structured.worker"
FORK_SERVER_SIGNALS_MODULE = "engine.structured.fork_server_signals"  # the server alone decides when they stop
# A check that has used this much CPU drops to the lowest priority (a multi-level feedback queue of two
# levels): a small grammar that arrives while big ones compile gets the CPU first, so it is not slowed by
# them however many there are. Its worker is replaced afterwards (a process cannot raise its priority again).
DEMOTE_AFTER_S = 0.5
DEMOTED_NICE = 19


class GrammarWorkerError(RuntimeError):
    """No compiler process could be started: the server's fault, not the grammar's (a 503)."""


@dataclass(eq=False)
class Job:
    """One grammar to check; its future gets None (fine), InvalidRequestError (a 400), GrammarWorkerError,
    or is cancelled."""

    spec: GrammarSpec
    future: Future[None] = field(default_factory=Future)
    cancelled: bool = False


@dataclass
class PoolCounts:
    """What the pool is doing and has done (for /metrics)."""

    queued: int = 0
    running: int = 0
    timed_out: int = 0  # killed at the deadline: "grammar too complex"
    cancelled: int = 0  # dropped or killed because every waiter left
    crashed: int = 0  # the worker died on the grammar (a stack overflow in xgrammar, say)
    demoted: int = 0  # checks that passed DEMOTE_AFTER_S of CPU and went on at the lowest priority


class GrammarPool:
    def __init__(self, tokenizer_info_json: Callable[[], str], workers: int, timeout_s: float) -> None:
        """tokenizer_info_json: xgrammar's TokenizerInfo of the model, serialized (called once, on first use).
        workers: processes; timeout_s: CPU seconds a grammar's parse and compile may take."""
        self.timeout_s = timeout_s
        self.counts = PoolCounts()
        self._tokenizer_info_json = tokenizer_info_json
        self._info_json: str | None = None
        self._info_lock = threading.Lock()
        # Held while a worker is being spawned: the fork server's child reads its start-up data from this
        # process, and a server that exits in the middle leaves it a traceback instead of a quiet exit.
        # close() takes it for good, so no spawn is half done (or begun) after it.
        self._spawning = threading.Lock()
        self._lock = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._closed = False
        # Slots whose first worker has started (or failed to): the server waits for all of them before it says
        # it is ready, since the fork server importing xgrammar and torch takes seconds of a core.
        self._first_starts = 0
        self._all_started = threading.Event()
        self._ids = itertools.count()
        self._slots = [
            threading.Thread(target=self._slot, name=f"grammar-slot-{i}", daemon=True) for i in range(workers)
        ]
        for slot in self._slots:
            slot.start()

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until every slot's first worker process has started (or failed to), at most timeout_s seconds
        in all; whether they all did in time."""
        return self._all_started.wait(timeout_s)

    def submit(self, spec: GrammarSpec) -> Job:
        job = Job(spec)
        with self._lock:
            if self._closed:
                job.future.set_exception(GrammarWorkerError("the grammar compiler is shut down"))
                return job
            self._queue.append(job)
            self.counts.queued += 1
            self._lock.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Nobody waits for the job any more: drop it if queued, kill its worker if running."""
        with self._lock:
            if job.future.done() or job.cancelled:
                return
            job.cancelled = True
            self.counts.cancelled += 1
            if job in self._queue:
                self._queue.remove(job)
                self.counts.queued -= 1
                job.future.cancel()
            # else a slot runs it: it sees the flag within POLL_S, kills the worker and cancels the future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self.counts.queued = 0
            self._lock.notify_all()
        self._spawning.acquire(timeout=SPAWN_WAIT_S)  # a spawn under way ends first; none starts after it

    # ---- the slots: one thread per worker process ----------------------------------------------------
    def _slot(self) -> None:
        worker: _Worker | None = None
        try:
            worker = self._start_worker()
            with self._lock:
                self._first_starts += 1
                if self._first_starts == len(self._slots):
                    self._all_started.set()
            while True:
                worker = worker or self._start_worker()  # warm before a job comes (again, after one was killed)
                job = self._take()
                if job is None:
                    return
                worker = worker or self._start_worker()
                if worker is None:
                    self._finish(job, GrammarWorkerError("no grammar compiler process could be started"))
                    time.sleep(RESTART_PAUSE_S)
                    continue
                worker = self._run(worker, job)
        finally:
            if worker is not None:
                worker.kill()

    def _take(self) -> Job | None:
        with self._lock:
            while not self._queue and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            self.counts.queued -= 1
            self.counts.running += 1
            return self._queue.popleft()

    def _start_worker(self) -> _Worker | None:
        if self._closed:
            return None
        try:
            with self._info_lock:  # one slot builds the vocabulary's description, the others wait for it
                if self._info_json is None:
                    self._info_json = self._tokenizer_info_json()
                info_json = self._info_json
            return _Worker.start(info_json, self._spawning)
        except (OSError, EOFError) as exc:
            # The fork server gone: a SIGTERM to the process group in the second it takes to start (later
            # it ignores SIGTERM: fork_server_signals.py). The slot retries; multiprocessing starts a new one.
            if not self._closed:
                logger.warning("a grammar compiler process failed to start (%s: %s); retrying", type(exc).__name__, exc)
            return None
        except Exception:
            if not self._closed:  # closing cancels the vocabulary's description: not worth a traceback
                logger.exception("a grammar compiler process failed to start")
            return None

    def _run(self, worker: _Worker, job: Job) -> _Worker | None:
        """Run the job on the worker; the worker back if it is still usable, None if it was killed or died."""
        spec = job.spec
        job_id = next(self._ids)
        started = time.monotonic()
        cpu_start = worker.cpu_seconds()
        try:
            worker.conn.send((job_id, spec))
            while True:
                if worker.conn.poll(POLL_S):
                    reply_id, error = worker.conn.recv()
                    assert reply_id == job_id, (reply_id, job_id)
                    self._finish(job, InvalidRequestError(error) if error is not None else None)
                    if worker.demoted:
                        worker.kill()  # the next check must not start at the lowest priority
                        return None
                    return worker
                if job.cancelled:
                    worker.kill()
                    self._finish(job, None, cancelled=True)
                    return None
                wall = time.monotonic() - started
                cpu = worker.cpu_seconds()
                used = cpu - cpu_start if cpu is not None and cpu_start is not None else wall
                if used > DEMOTE_AFTER_S and not worker.demoted:
                    worker.demote()
                    self.counts.demoted += worker.demoted
                if used > self.timeout_s or wall > WALL_FACTOR * self.timeout_s + WALL_GRACE_S:
                    worker.kill()
                    self.counts.timed_out += 1
                    logger.info("a %s passed the %g s compile deadline: worker killed", spec.describe(), self.timeout_s)
                    self._finish(
                        job,
                        InvalidRequestError(
                            f"grammar too complex: the {spec.describe()} did not compile within "
                            f"{self.timeout_s:g} s (--grammar-compile-timeout)"
                        ),
                    )
                    return None
        except (EOFError, OSError):
            code = worker.kill()
            self.counts.crashed += 1
            logger.warning("a grammar compiler process died on a %s (exit code %s)", spec.describe(), code)
            self._finish(
                job,
                InvalidRequestError(
                    f"grammar too complex: compiling the {spec.describe()} crashed the compiler (exit code {code})"
                ),
            )
            return None

    def _finish(self, job: Job, error: BaseException | None, cancelled: bool = False) -> None:
        with self._lock:
            self.counts.running -= 1
        if cancelled:
            job.future.cancel()
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(None)


class _Worker:
    """A compiler process and the pipe to it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.demoted = False  # at DEMOTED_NICE for the rest of its life

    def demote(self) -> None:
        """The lowest CPU priority from now on (where the OS allows: else it keeps its nice +10)."""
        with contextlib.suppress(AttributeError, OSError, TypeError):
            os.setpriority(os.PRIO_PROCESS, self.process.pid, DEMOTED_NICE)  # type: ignore[arg-type]
            self.demoted = True

    @staticmethod
    def start(info_json: str, spawning: threading.Lock) -> _Worker:
        from engine.structured.worker import serve

        context = _context()
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(child, info_json), name="grammar-compiler", daemon=True)
        if not spawning.acquire(timeout=SPAWN_WAIT_S):
            raise GrammarWorkerError("the grammar compiler is shutting down")
        try:
            process.start()
        finally:
            spawning.release()
        child.close()
        worker = _Worker(process, parent)
        if not parent.poll(START_TIMEOUT_S) or parent.recv() != ("ready",):
            worker.kill()
            raise GrammarWorkerError(f"the grammar compiler process was not ready within {START_TIMEOUT_S:.0f} s")
        return worker

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the process so far, or None where /proc cannot tell."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)": state is field 3
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # fields 14, 15: utime, stime
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> int | None:
        """SIGKILL, reaped; its exit code (None if it was already gone and unknown)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()
        return self.process.exitcode


@functools.cache
def _context() -> Any:
    """The fork server where one exists (Linux, macOS): it imports the worker module, and xgrammar with it,
    once, so a replacement worker is a fork, not a fresh interpreter that imports torch again."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # Not __main__: the server's own module stays out.
        context.set_forkserver_preload([FORK_SERVER_SIGNALS_MODULE, WORKER_MODULE])
        return context
    return multiprocessing.get_context("spawn")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
