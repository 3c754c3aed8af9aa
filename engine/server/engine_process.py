"""The engine in a process of its own, behind a pipe (the server's `process` transport).

Why: in one process the engine's step loop and the HTTP event loop share the
GIL. At hundreds of concurrent streams the event loop's work per step (one
chunk per stream: queue hand-off, JSON, socket write) is as long as a GPU
decode step, and the engine thread, each time it wakes from a device wait,
queues for the GIL for up to the interpreter's 5 ms switch interval. On the
H200 that held the server at 0.68-0.78 of the in-process throughput at
concurrency 256. vLLM's engine core and SGLang's scheduler run in their own
processes for the same reason.

Protocol (multiprocessing.Pipe, pickled tuples; nothing that grows with a
request's context crosses per step):
- server -> engine: the EngineLoop commands (engine/server/engine_loop.py).
- engine -> server: ("ready", EngineInfo) once, or ("dead", error) if the engine cannot be built;
  ("accepted", request_id, error); ("outputs", [compact output, ...]);
  ("failed", request_ids, error); ("stats", EngineStats).
A streamed output carries its deltas only; the final one carries the whole
text, token ids and logprobs once (what a non-streaming response needs).

The child ignores SIGINT (a Ctrl-C reaches the whole process group; the server
decides when to stop it) and exits when the server's end of the pipe closes,
so it never outlives a killed server. If the child dies, every open request
ends with EngineDeadError and /health answers 503.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import EngineConfig
from engine.errors import (
    EngineError,
)
from engine.server.engine_loop import Command, EngineDeadError, EngineLoop
from engine.server.engine_pipes import EnginePipes, TerminateRequest
from engine.server.events_encoding import decode_error, deliver_event, encode_error
from engine.server.streams import StreamRouter
from engine.stats import EngineStats

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger("engine.server.engine_process")


@dataclass
class EngineInfo:
    """What the server needs of the engine to validate and tokenize requests."""

    model: str | None  # the engine config's model path (None: the embedded model)
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the HF tokenizer (pickled across), or None for a model without one
    stats: EngineStats
    page_size: int = 16  # tokens per KV page (the data-parallel router mirrors prefix caches in pages)
    lora_adapters: dict[str, str] | None = None  # loaded LoRA adapters (name -> folder); None: LoRA is off


def engine_info(engine: Engine) -> EngineInfo:
    """What the server needs of an engine built elsewhere (an engine process, a Ray actor)."""
    return EngineInfo(
        engine.config.model,
        engine.max_model_len,
        int(engine.model_config.vocab_size),
        engine.tokenizer,
        engine.stats(),
        engine.kv_pool.page_size,
        engine.lora_adapters() if engine.lora is not None else None,
    )


class EngineHandle(Protocol):
    """What the server uses of an engine in another process (or several): an EngineProcess, a ReplicaSet, or an
    extra API server's EngineClient (engine/server/api_servers.py)."""

    info: EngineInfo | None  # set once the engine is ready
    on_terminate: Callable[[], None] | None  # a SIGTERM the engine got: the server's graceful shutdown

    @property
    def alive(self) -> bool: ...

    def send(self, command: Command) -> None: ...

    def start_events(self, router: StreamRouter) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...


@dataclass(frozen=True)
class Placement:
    """Where an engine process runs: its share of the host (a data-parallel replica's), or all of it."""

    torch_threads: int | None = None  # intra-op threads (None: torch's default)
    cpu_cores: tuple[int, ...] | None = None  # the cores it may run on (None: any)
    visible_devices: str | None = None  # the devices it sees (None: inherited) ...
    visible_devices_env: str = "CUDA_VISIBLE_DEVICES"  # ... through the platform's variable
    name: str = "engine"  # its tag in the log lines


def run_engine_process(
    config: EngineConfig,
    conn: Connection,
    placement: Placement,
    log_level: str,
    api_conns: tuple[Connection, ...] = (),
) -> None:
    """The child's entry point: build the engine, report ready, run the loop until told to stop. conn: the main
    server's pipe; api_conns: those of the extra API-server processes (engine/server/engine_pipes.py)."""
    # The server starts this process as a daemon (it dies with the server), and multiprocessing refuses
    # children to daemons; a tensor-parallel engine spawns its ranks here, and watches and stops them itself.
    multiprocessing.current_process().daemon = False
    if placement.visible_devices is not None:  # before anything initialises the device
        os.environ[placement.visible_devices_env] = placement.visible_devices
    if placement.cpu_cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpu_cores)
    torch_threads = placement.torch_threads
    # Ctrl-C and SIGTERM reach the whole process group (a terminal, `docker stop`, systemd). The server
    # decides when the engine stops: Ctrl-C is its alone, a SIGTERM is passed on to it (TerminateRequest),
    # and the pipe's end stops this process if the server is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminate = TerminateRequest()
    signal.signal(signal.SIGTERM, terminate.handle)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [{placement.name}]: %(message)s", stream=sys.stderr
    )
    try:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        from engine.engine import Engine

        start = time.perf_counter()
        engine = Engine(config)
        info = engine_info(engine)
        logger.info("engine process %d ready in %.1f s", os.getpid(), time.perf_counter() - start)
    except BaseException as exc:
        conn.send(("dead", encode_error(exc)))
        if isinstance(exc, EngineError):
            sys.exit(1)  # a user's error (bad model, bad flag): the server prints it, no traceback here
        raise
    conn.send(("ready", info))
    pipes = EnginePipes([conn, *api_conns], terminate)
    loop = EngineLoop(engine, pipes, pipes.receive)
    try:
        loop.run()
    finally:
        engine.shutdown()  # a tensor-parallel engine's ranks stop with it, whatever ended the loop
        pipes.close()


# ---- the server's handle on it -------------------------------------------------------------------


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        torch_threads: int | None = None,
        placement: Placement | None = None,
        api_servers: int = 1,
    ) -> None:
        """api_servers: the API-server processes the engine serves (engine/server/api_servers.py); after start(),
        `api_pipes` holds the server ends of the pipes of all but this one."""
        self.config = config
        self.placement = placement or Placement(torch_threads=torch_threads)
        self.api_servers = api_servers
        self.api_pipes: list[Connection] = []
        self.info: EngineInfo | None = None  # type: ignore[assignment]
        self.error: str | None = None  # why the process ended, when it did on its own
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._dead = False
        self._stopping = False
        # Called (on the events thread) when the engine process gets SIGTERM: the server's graceful shutdown.
        # None: the process is stopped at once.
        self.on_terminate: Callable[[], None] | None = None
        # Called with stop()'s timeout before the engine is stopped: the other API servers drain first.
        self.before_stop: Callable[[float], None] | None = None

    def start(self, ready_timeout: float | None = None) -> EngineInfo:
        """Spawn the engine process and wait until its engine is built; raises its error if it fails."""
        # spawn, not fork: a forked child of a process that touched CUDA (or OpenMP) cannot use it.
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        extra = [context.Pipe() for _ in range(self.api_servers - 1)]
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self._process = context.Process(
            target=run_engine_process,
            name="engine-core",
            args=(self.config, child, self.placement, level, tuple(engine_end for _, engine_end in extra)),
            daemon=True,
        )
        self._process.start()
        child.close()
        for _, engine_end in extra:
            engine_end.close()
        self.api_pipes = [server_end for server_end, _ in extra]
        self._conn = parent
        logger.info("engine process %d started (%s); building the engine", self._process.pid, self.placement.name)
        deadline = None if ready_timeout is None else time.monotonic() + ready_timeout
        while not parent.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._process.exitcode} while starting")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise TimeoutError(f"the engine was not ready within {ready_timeout:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            raise RuntimeError(
                f"the engine process exited with code {self._process.join(5) or self._process.exitcode} while starting"
            ) from None
        if kind != "ready":
            self._process.join(10)
            raise decode_error(payload) or RuntimeError("the engine process failed to start")
        self.info = payload
        return payload

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and not self._dead

    def send(self, command: Command) -> None:
        assert self._conn is not None, "start() first"
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError) as exc:  # the pipe is closed: the process is gone
            raise EngineDeadError(f"the engine process is gone ({exc})") from None

    def start_events(self, router: StreamRouter) -> None:
        """Read the engine's events on a thread of this process and route them to the handlers."""
        self._reader = threading.Thread(target=self._read, args=(router,), name="engine-events", daemon=True)
        self._reader.start()

    def _read(self, router: StreamRouter) -> None:
        assert self._conn is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "terminate":
                self._terminate_requested(message[1])
            else:
                deliver_event(message, router)
        self._dead = True
        if not self._stopping:
            assert self._process is not None
            self._process.join(5)
            self.error = f"the engine process exited unexpectedly (exit code {self._process.exitcode})"
            logger.error("%s (%s); its open requests fail", self.error, self.placement.name)
        router.fail_everything(EngineDeadError(self.error or "the server is shutting down"))

    def _terminate_requested(self, signal_name: str) -> None:
        if self.on_terminate is not None:
            logger.info("the engine process got %s: the server shuts down", signal_name)
            self.on_terminate()
            return
        # Nobody above to drain requests first: stop the loop now (it fails what is open).
        logger.info("the engine process got %s: stopping it", signal_name)
        self._stopping = True
        self.error = f"the engine process was stopped ({signal_name})"
        with contextlib.suppress(EngineDeadError):
            self.send(("stop",))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (it fails what is still open), then the process."""
        self._stopping = True
        if self._process is None:
            return
        if self.before_stop is not None:
            self.before_stop(timeout)
        with contextlib.suppress(EngineDeadError):
            self.send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("engine process did not stop within %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        logger.info("engine process stopped")
