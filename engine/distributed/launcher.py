"""Rank 0's side of tensor parallelism: spawn the worker ranks, watch them, stop them.

`RankGroup.start` spawns ranks 1..N-1 (torch.multiprocessing, spawn: a fresh
interpreter each, never a fork of a process that may hold CUDA or OpenMP
state), waits until each reports that it started, then joins the process group
with them. Every worker reports over a pipe of its own ("started", "ready",
"failed" with its traceback); a monitor thread reads those pipes and the
processes' sentinels, so a rank that dies is seen at once, whatever rank 0 is
doing. When a collective or a message fails on rank 0, `failure` turns it into
one RankFailedError naming the rank (died, with its exit code or signal; hung:
alive but silent past the collective timeout; failed: its own error) and stops
the others: a tensor-parallel step needs every rank, so the engine cannot go on.

Shutdown (Engine.shutdown, at exit, and on SIGTERM when rank 0 runs in the main
thread): a STOP message, then each worker is given a few seconds to leave the
group, then terminated, then killed.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from engine.distributed.channel import Command, RankGoneError, StepChannel
from engine.distributed.process_group import create_store, destroy_tensor_parallel, init_tensor_parallel
from engine.distributed.state import TensorParallelState
from engine.errors import EngineStoppedError, RankFailedError

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # a worker told to stop has this long to leave before it is terminated
# Start-up (spawn, imports, loading the model, capturing graphs) may take far longer than one collective:
# a worker has at least this long to report that it started and that its engine is built.
START_TIMEOUT_S = 900.0
DIAGNOSE_GRACE_S = 2.0  # after a failed collective: how long to wait for a rank's death or report to show


@dataclass
class _Worker:
    rank: int
    process: Any  # multiprocessing.Process (spawn context)
    commands: Connection  # rank 0 -> worker: the StepChannel
    reports: Connection  # worker -> rank 0: status reports, read by the monitor thread
    status: str = "spawned"  # started, ready, failed, stopped
    error: str = ""  # its traceback, when it reported one
    ended: bool = False  # the monitor saw the process exit (and read its last reports first)
    # Its exit status, as the monitor reaped it. Only the monitor thread waits for the process: two threads
    # reaping one child race (the loser sees no status at all).
    exit_code: int | None = None

    def describe_exit(self) -> str:
        code = self.exit_code
        if code is None:
            return "is alive"
        if code < 0:
            try:
                return f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"


# A rank that got SIGTERM finishes its step in flight and leaves within this long (engine/tp_worker.py).
TERM_GRACE_S = 5.0


class RankGroup:
    """The worker ranks (1..world-1) of the tensor-parallel engine whose rank 0 is this process.

    worker_main: each spawned rank's process entry (engine/tp_worker.py, which builds an Engine: it sits above
    this module in the layers, so the Engine hands it in)."""

    def __init__(
        self, world_size: int, backend: str, timeout_s: float, device: torch.device, worker_main: Callable[..., None]
    ) -> None:
        self.worker_main = worker_main
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device
        self.workers: list[_Worker] = []
        self.channel: StepChannel | None = None
        self.failed: RankFailedError | None = None
        self._stopping = False  # exits from here on are expected (stopping or stopped): not logged as failures
        self._closed = False
        self._changed = threading.Condition()
        self._monitor: threading.Thread | None = None
        self._previous_sigterm: Any = None
        self._in_step = False  # rank 0 is between sending a step and its tokens' broadcast
        self._exit_code: int | None = None  # SIGTERM arrived during a step: exit once it is over
        self._store: Any = None  # rank 0's rendezvous store: kept alive with the group

    # ---- start-up ------------------------------------------------------------------------------
    def start(self, config: Any) -> TensorParallelState:
        """Spawn the workers (each builds the same engine from `config`), join the group with them."""
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        threads = torch.get_num_threads()
        if self.device.type == "cpu" and threads * self.world_size > (os.cpu_count() or 1):
            # Every rank runs with rank 0's thread count; more threads than cores made a tiny model's decode
            # step 9x slower here (OpenMP teams spinning against each other and gloo).
            logger.warning(
                "%d ranks x %d threads on %d cores: oversubscribed; give each rank cores / ranks threads "
                "(OMP_NUM_THREADS=%d)",
                self.world_size,
                threads,
                os.cpu_count() or 1,
                max(1, (os.cpu_count() or 1) // self.world_size),
            )
        store = self._store = create_store(self.world_size, self.timeout_s)
        for rank in range(1, self.world_size):
            command_recv, command_send = context.Pipe(duplex=False)
            report_recv, report_send = context.Pipe(duplex=False)
            process = context.Process(
                target=self.worker_main,
                name=f"engine-tp-rank{rank}",
                args=(
                    rank,
                    self.world_size,
                    store.port,
                    config,
                    command_recv,
                    report_send,
                    threads,
                    os.getpid(),
                    logging.getLogger().getEffectiveLevel(),
                ),
            )
            process.start()
            command_recv.close()  # the child's ends: closed here so a dead child shows as EOF / a broken pipe
            report_send.close()
            self.workers.append(_Worker(rank, process, command_send, report_recv))
        atexit.register(self.shutdown)
        self._install_sigterm()
        self._monitor = threading.Thread(target=self._watch, name="engine-tp-monitor", daemon=True)
        self._monitor.start()
        self._await("started", "start")
        state = self._join(store)
        self.channel = StepChannel([w.commands for w in self.workers])
        return state

    def _join(self, store: Any) -> TensorParallelState:
        """Rank 0 joins the group. The rendezvous blocks until every rank arrives and does not notice a rank
        that died on the way, so it runs on a thread while this one watches the workers."""
        outcome: dict[str, Any] = {}

        def join() -> None:
            try:
                outcome["state"] = init_tensor_parallel(
                    0, self.world_size, self.backend, self.timeout_s, store=store, device=self.device
                )
            except BaseException as exc:
                outcome["error"] = exc
            with self._changed:
                self._changed.notify_all()

        joiner = threading.Thread(target=join, name="engine-tp-join", daemon=True)
        joiner.start()
        with self._changed:
            while joiner.is_alive():
                broken = [w for w in self.workers if w.status == "failed" or w.ended]
                if broken:
                    raise self._fail(self._explain(broken, timed_out=False) + " (while the ranks joined the group)")
                self._changed.wait(0.5)
        if "error" in outcome:
            raise self.failure(outcome["error"])
        state: TensorParallelState = outcome["state"]
        return state

    def wait_ready(self) -> None:
        """Every worker has built its engine (model, KV pool, graphs) and waits for steps."""
        self._await("ready", "build its engine")
        logger.info(
            "tensor parallelism: %d ranks ready (pids %s)",
            self.world_size,
            ", ".join(str(w.process.pid) for w in self.workers),
        )

    def _await(self, status: str, what: str) -> None:
        limit = max(self.timeout_s, START_TIMEOUT_S)
        deadline = time.monotonic() + limit
        order = ("spawned", "started", "ready")
        with self._changed:
            while True:
                if self.failed is not None:
                    raise self.failed
                broken = [w for w in self.workers if w.status == "failed" or w.ended]
                if broken:
                    hint = ""
                    if status == "started" and any(w.status == "spawned" and not w.error for w in broken):
                        # multiprocessing's spawn runs the main script again in the child, unless it is guarded.
                        hint = (
                            "; a script that builds a tensor-parallel engine must do so under "
                            '`if __name__ == "__main__":`'
                        )
                    raise self._fail(self._explain(broken, timed_out=False) + f" (before it could {what}){hint}")
                if all(order.index(w.status) >= order.index(status) for w in self.workers if w.status in order):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    silent = [
                        w for w in self.workers if w.status in order and order.index(w.status) < order.index(status)
                    ]
                    raise self._fail(
                        "; ".join(
                            f"tensor-parallel rank {w.rank} (pid {w.process.pid}) did not {what} within {limit:.0f} s"
                            for w in silent
                        )
                    )
                self._changed.wait(min(left, 1.0))

    # ---- monitoring ----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Reads every worker's reports and notices every worker's exit, until all have exited."""
        while True:
            watching = [w for w in self.workers if not w.ended]
            if not watching:
                return
            sources: list[Any] = [w.process.sentinel for w in watching]
            sources += [w.reports for w in watching if not w.reports.closed]
            ready = wait(sources, timeout=1.0)
            with self._changed:
                for worker in watching:
                    if not worker.reports.closed and worker.reports in ready:
                        self._read_report(worker)
                    if worker.process.sentinel in ready:
                        worker.process.join(5.0)  # the sentinel closes a moment before the exit status is there
                        worker.exit_code = worker.process.exitcode
                        while not worker.reports.closed and worker.reports.poll():  # its last words first
                            self._read_report(worker)
                        worker.ended = True
                        if not self._stopping:
                            logger.error(
                                "tensor-parallel rank %d (pid %d) %s%s",
                                worker.rank,
                                worker.process.pid,
                                worker.describe_exit(),
                                f": {worker.error.strip().splitlines()[-1]}" if worker.error else "",
                            )
                self._changed.notify_all()

    def _read_report(self, worker: _Worker) -> None:
        try:
            status, detail = worker.reports.recv()
        except (EOFError, OSError):
            worker.reports.close()
            return
        worker.status = status
        if status == "failed":
            worker.error = str(detail)

    # ---- failures ------------------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Before each step: the engine stopped already, or a worker died since the last step."""
        if self.failed is not None:
            raise self.failed
        if self._closed:
            raise EngineStoppedError("this tensor-parallel engine was shut down (Engine.shutdown()); build a new one")
        if not self._stopping and any(w.ended or w.status == "failed" for w in self.workers):
            raise self.failure(RuntimeError("a worker rank is gone"))

    def failure(self, error: BaseException) -> RankFailedError:
        """What a failed collective or message on rank 0 means: one RankFailedError naming the rank at
        fault; every rank is stopped, since no step can run without all of them."""
        if self.failed is not None:
            return self.failed
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        deadline = time.monotonic() + DIAGNOSE_GRACE_S
        with self._changed:
            # Give a death or a failure report the time to arrive (a killed rank's sentinel, the traceback of
            # a rank that raised, or, after a timeout, the reports of the ranks that were only waiting).
            while time.monotonic() < deadline and not any(w.ended for w in self.workers):
                self._changed.wait(0.1)
            broken = [w for w in self.workers if w.ended or w.status == "failed"]
            message = self._explain(broken, timed_out)
        if not message:
            message = f"tensor-parallel rank 0 failed: {type(error).__name__}: {error}"
            if isinstance(error, RankGoneError):
                message = f"tensor-parallel rank {error.rank} is gone: {error}"
        return self._fail(message)

    def _explain(self, broken: list[_Worker], timed_out: bool) -> str:
        """Which rank is at fault: one that died without a word, else one that hangs (alive, silent past a
        timeout), else every one that reported its own error."""
        killed = [w for w in broken if w.status != "failed"]
        if killed:
            return "; ".join(f"tensor-parallel rank {w.rank} (pid {w.process.pid}) {w.describe_exit()}" for w in killed)
        if timed_out:
            silent = [w for w in self.workers if w not in broken]
            if silent:
                return "; ".join(
                    f"tensor-parallel rank {w.rank} (pid {w.process.pid}) did not respond within the "
                    f"{self.timeout_s:.0f} s collective timeout (hung?)"
                    for w in silent
                )
        return "; ".join(
            f"tensor-parallel rank {w.rank} (pid {w.process.pid}) failed: {(w.error.strip().splitlines() or ['?'])[-1]}"
            for w in broken
        )

    def _fail(self, message: str) -> RankFailedError:
        """Record the error, stop every rank and leave the group (a new engine may then start)."""
        self.failed = RankFailedError(f"{message}; the engine stops (a tensor-parallel step needs every rank)")
        logger.error("%s", self.failed)
        self.shutdown()
        return self.failed

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around each step on rank 0: a SIGTERM that arrives inside takes effect once every rank is done
        with the step, so the workers are back in their loop and take the STOP message."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        if self._exit_code is not None:
            raise SystemExit(self._exit_code)

    # ---- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (a STOP message, a grace period, then terminate) and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = self._stopping = True
        atexit.unregister(self.shutdown)
        if self.channel is not None and self.failed is None:
            with suppress(RankGoneError):
                self.channel.publish(Command.STOP)
            self._wait_ended(STOP_GRACE_S)
        self._terminate()
        destroy_tensor_parallel()
        self._restore_sigterm()
        for worker in self.workers:
            worker.commands.close()

    def _terminate(self) -> None:
        """Workers still running: SIGTERM (a worker leaves TERM_GRACE_S after it), then SIGKILL (a stopped,
        SIGSTOP'd one takes only that). After a failure straight to SIGKILL: a rank that hangs would not act
        on SIGTERM either."""
        running = [w for w in self.workers if not w.ended]
        for worker in running:
            worker.process.kill() if self.failed is not None else worker.process.terminate()
        if running and not self._wait_ended(TERM_GRACE_S + 1.0):
            for worker in self.workers:
                if not worker.ended:
                    worker.process.kill()
            self._wait_ended(5.0)

    def _wait_ended(self, timeout_s: float) -> bool:
        """Wait until the monitor has seen every worker exit; False if some are still running after timeout_s."""
        if self._monitor is None or not self._monitor.is_alive():
            for worker in self.workers:  # no monitor (a failed start, or all ended): reap here
                if not worker.ended:
                    worker.process.join(timeout_s)
                    worker.exit_code = worker.process.exitcode
                    worker.ended = worker.exit_code is not None
            return all(w.ended for w in self.workers)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not all(w.ended for w in self.workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.5))
        return True

    def _install_sigterm(self) -> None:
        """SIGTERM on rank 0 exits through Python (so atexit stops the workers) where nobody else handles it."""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        ):
            return

        def on_sigterm(signum: int, frame: object) -> None:
            if self._in_step:
                self._exit_code = 128 + signum  # leaving mid-step would leave the workers inside a collective
                return
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
