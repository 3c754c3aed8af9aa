"""The engine side of serving: commands in, events out, on the one thread that owns the engine.

The Engine is not thread-safe, so exactly one thread calls it. That thread runs
`EngineLoop.run`: it takes the server's commands (add, abort, fail_all, stop),
steps the engine while anything is unfinished, and reports what happened to an
`EngineEvents` sink. The same loop serves both ways the server can hold the
engine (engine/server/async_engine.py): on a thread of the server process, where
the sink routes outputs straight to the HTTP handlers, and in an engine process
of its own (engine/server/engine_process.py), where the sink writes them to a pipe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from engine.engine import Engine
from engine.errors import EngineError, EngineStoppedError, RequestFailedError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger("engine.server.async_engine")

IDLE_POLL_S = 0.5  # how long an idle engine blocks waiting for a command
STATS_INTERVAL_S = 0.1  # at most this often a busy engine reports its counters (they feed /metrics)

# Commands, as tuples (they cross a pipe in the engine-process mode):
#   ("add", request_id, prompt_token_ids, params)  ("abort", request_id)
#   ("fail_all", message)                           ("stop",)
#   ("lora", ticket, "load" | "unload", name, path): its result comes back as accepted(ticket, error)
Command = tuple


class EngineDeadError(RuntimeError):
    """The engine is gone (shut down, its process died, or a bug killed its loop)."""


class EngineEvents(Protocol):
    """Where the loop reports; every method is called on the engine's thread."""

    def accepted(self, request_id: str, error: BaseException | None) -> None:
        """The add of request_id went through (error None) or was refused with error."""

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs (an output with .error set: that request made the step fail)."""

    def failed(self, request_ids: list[str], error: BaseException) -> None:
        """These requests ended with error (a failed step, fail_all, shutdown)."""

    def stats(self, snapshot: EngineStats) -> None:
        """The engine's counters, after a step (at most every STATS_INTERVAL_S) and when idle."""


class EngineLoop:
    def __init__(self, engine: Engine, events: EngineEvents, receive: Callable[[float | None], list[Command]]) -> None:
        """receive(timeout): the commands that arrived, waiting up to timeout seconds for the first
        (None: not at all); an empty list when none came."""
        self.engine = engine
        self.events = events
        self.receive = receive
        self.live: set[str] = set()  # requests added through the loop that have not ended
        self.error: BaseException | None = None
        self._stopping = False
        self._stats_at = 0.0

    def run(self) -> None:
        """Until a stop command (or a bug in the engine): then every open request gets an error."""
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished()
                for command in self.receive(None if busy else IDLE_POLL_S):
                    self.handle(command)
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    self.step()
                self._report_stats(force=not self.engine.has_unfinished())
        except BaseException as exc:  # a bug: report it to every request rather than hang clients
            logger.exception("engine loop died")
            self.error = exc
        finally:
            self.end(
                EngineDeadError("the server is shutting down" if self.error is None else f"engine failed: {self.error}")
            )

    def handle(self, command: Command) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_token_ids, params = command
            self._add(request_id, prompt_token_ids, params)
        elif kind == "abort":
            request_id = command[1]
            if request_id in self.live:
                self.live.discard(request_id)
                self.engine.abort(request_id)
                logger.debug("aborted %s", request_id)
        elif kind == "fail_all":
            self._fail(list(self.live), EngineDeadError(command[1]))
        elif kind == "stop":
            self._stopping = True
        elif kind == "lora":
            _, ticket, op, name, path = command
            try:
                if op == "load":
                    self.engine.load_lora_adapter(name, path)
                else:
                    self.engine.unload_lora_adapter(name)
            except EngineError as exc:  # InvalidRequestError: an unknown, busy, bad or unloadable adapter
                self.events.accepted(ticket, exc)
            else:
                self.events.accepted(ticket, None)
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(prompt_token_ids, params, request_id=request_id)
        except Exception as exc:
            if not isinstance(exc, EngineError):
                logger.exception("add_request failed for %s", request_id)
            self.events.accepted(request_id, exc)
            return
        self.live.add(request_id)
        self.events.accepted(request_id, None)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineStoppedError:
            raise  # a tensor-parallel rank is gone: the engine cannot step again, so the loop ends (run())
        except Exception as exc:
            self._fail_step(exc)
            return
        delivered = []
        for output in outputs:
            if output.request_id not in self.live:
                continue  # aborted while the step ran
            if output.error is not None or output.finished:
                self.live.discard(output.request_id)
            delivered.append(output)
        if delivered:
            self.events.outputs(delivered)

    def _fail_step(self, exc: Exception) -> None:
        """The requests the failed step dropped get the error; everything else keeps going."""
        logger.exception("engine step failed")
        scheduler = self.engine.scheduler
        remaining = list(scheduler.running) + list(scheduler.waiting)
        if scheduler.chunked is not None:  # a request part-way through a chunked prefill
            remaining.append(scheduler.chunked)
        still_there = {r.request_id for r in remaining}
        dropped = [request_id for request_id in self.live if request_id not in still_there]
        if not dropped:
            # Nothing identifiable was dropped: fail everything rather than fail the same way forever.
            dropped = list(self.live)
        self._fail(dropped, RequestFailedError(f"generation failed: {type(exc).__name__}: {exc}"))

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            self.live.discard(request_id)
            try:
                self.engine.abort(request_id)  # frees its pages; a no-op when the engine already dropped it
            except Exception:
                logger.exception("abort of %s failed", request_id)
        if request_ids:
            self.events.failed(request_ids, error)

    def end(self, error: BaseException) -> None:
        """Fail what is open, refuse adds that arrived too late, report the final counters."""
        self._fail(list(self.live), error)
        try:
            late = self.receive(None)
        except Exception:
            late = []
        for command in late:
            if command[0] == "add":
                self.events.accepted(command[1], error)
        self._report_stats(force=True)

    def _report_stats(self, force: bool) -> None:
        now = time.perf_counter()
        if not force and now - self._stats_at < STATS_INTERVAL_S:
            return
        self._stats_at = now
        try:
            self.events.stats(self.engine.stats())
        except Exception:
            logger.exception("stats update failed")
