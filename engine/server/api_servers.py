"""Several API-server processes over one engine process: `engine serve --api-server-count N` (vLLM's flag).

One event loop parses, validates, tokenizes and streams for every client; at hundreds of clients arriving at
once it is what a request waits for before the engine sees it. With N > 1 the main process binds the listening
socket and starts the engine process with one pipe per API server (engine/server/engine_pipes.py routes each
request's events back on its own pipe); then N - 1 more processes each run the same app on the same socket
(the kernel hands each new connection to one of them), with an `EngineClient` on their pipe in place of the
main server's `EngineProcess`. Every guarantee holds per process: the connection gate, body and pending
limits (each process applies the configured limits to its own connections), aborts on disconnect.

The counters and latency histograms of /metrics are shared through prometheus_client's multiprocess mode
(every process renders their sum); the engine's own series come to every process in its stats. The requests a
server holds before the engine (engine:num_requests_pending) are the answering process's.

Shutdown: each process drains its own connections on SIGINT/SIGTERM (a terminal's Ctrl-C and `docker stop`
reach them all). The main server, before it stops the engine, tells the others to drain (it closes a pipe
each watches; one already draining ignores it) and waits for them, so that their last requests finish; a SIGTERM to the
main process alone therefore stops them all. An API server whose process dies has its open requests aborted
by the engine; the others keep serving.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.server.engine_loop import Command, EngineDeadError
from engine.server.engine_process import EngineInfo
from engine.server.events_encoding import deliver_event
from engine.server.streams import StreamRouter

if TYPE_CHECKING:
    from engine.server.connections import GatedServer

logger = logging.getLogger("engine.server.api_servers")

POLL_S = 0.2  # how often an EngineClient's reader looks whether it was stopped, while no event comes
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable for its multiprocess mode


class EngineClient:
    """An extra API server's handle on the engine process (what build_app and AsyncEngine use of an
    EngineProcess): commands down its pipe, events from it on a thread. It does not own the process: stop()
    closes the pipe, and the engine aborts whatever this server left open."""

    def __init__(self, conn: Connection, info: EngineInfo, index: int) -> None:
        self.conn = conn
        self.info = info
        self.index = index
        self.on_terminate = None  # only the main server hears of a SIGTERM the engine process got
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._dead = False
        self._stopping = False

    @property
    def alive(self) -> bool:
        return not self._dead

    def send(self, command: Command) -> None:
        try:
            with self._send_lock:
                self.conn.send(command)
        except (OSError, ValueError) as exc:
            raise EngineDeadError(f"the engine process is gone ({exc})") from None

    def start_events(self, router: StreamRouter) -> None:
        self._reader = threading.Thread(target=self._read, args=(router,), name="engine-events", daemon=True)
        self._reader.start()

    def _read(self, router: StreamRouter) -> None:
        # Polled, so that stop() needs no close from another thread under a blocked recv; the pipe is closed here.
        while not self._stopping:
            try:
                if not self.conn.poll(POLL_S):
                    continue
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            deliver_event(message, router)
        self._dead = True
        self.conn.close()  # the engine aborts whatever this server left open
        if not self._stopping:
            logger.error("API server %d: the engine process closed its pipe; open requests fail", self.index)
        router.fail_everything(EngineDeadError("the engine is not running"))

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._reader is not None:
            self._reader.join(timeout)
        else:
            self.conn.close()


def run_api_server(
    index: int,
    args: argparse.Namespace,
    info: EngineInfo,
    conn: Connection,
    listening: socket.socket,
    drain: Connection,
    log_level: str,
) -> None:
    """An extra API server's entry point: the app over its pipe, on the main process's socket, until a signal
    stops it or the main process closes the other end of `drain` (its shutdown, or its death)."""
    from engine.server.http_server import serve_http

    # Started as a daemon (it dies with the main process), which multiprocessing would hold against the grammar
    # compiler processes it starts; it stops them itself when it stops.
    multiprocessing.current_process().daemon = False
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [api-server {index}]: %(message)s",
        stream=sys.stderr,
    )

    def watch_drain(server: GatedServer) -> None:
        def wait() -> None:
            with contextlib.suppress(EOFError, OSError):
                drain.recv()  # nothing is ever sent: this returns when the main process closes its end
            server.request_shutdown()

        threading.Thread(target=wait, name="drain-watch", daemon=True).start()

    serve_http(EngineClient(conn, info, index), args, sockets=[listening], index=index, on_server=watch_drain)


class ApiServers:
    """The main process's handle on the extra API-server processes."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        # One pipe per server, whose closing tells it to drain: unlike a multiprocessing.Event, nothing hangs on
        # it when a server was killed while waiting (an Event's set() then waits for the dead waiter forever).
        self._drains: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []

    def start(
        self, args: argparse.Namespace, info: EngineInfo, pipes: list[Connection], listening: socket.socket
    ) -> None:
        """One process per pipe (the pipes EngineProcess made beside its own), numbered from 1."""
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        for index, conn in enumerate(pipes, start=1):
            drain_end, drain = self._context.Pipe(duplex=False)
            process = self._context.Process(
                target=run_api_server,
                name=f"api-server-{index}",
                args=(index, args, info, conn, listening, drain_end, level),
                daemon=True,
            )
            process.start()
            conn.close()  # the child holds its own copy; the engine's end sees EOF once the child is gone
            drain_end.close()
            self._drains.append(drain)
            self.processes.append(process)
        logger.info("%d more API-server processes started: %s", len(pipes), [p.pid for p in self.processes])

    def stop(self, timeout: float) -> None:
        """Tell every other API server to drain, and wait for them (up to timeout seconds, then end them)."""
        for drain in self._drains:
            drain.close()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                logger.warning("%s did not stop within %.0f s; terminating it", process.name, timeout)
                process.terminate()
                process.join(5)
        logger.info("API-server processes stopped (exit codes %s)", [p.exitcode for p in self.processes])


def prepare_shared_metrics() -> str:
    """Before prometheus_client is first imported in this process (and before the API servers start): its
    multiprocess mode, over a fresh directory this process removes at exit."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before its multiprocess directory was set")
    directory = tempfile.mkdtemp(prefix="engine-metrics-")
    os.environ[MULTIPROCESS_DIR_ENV] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory
