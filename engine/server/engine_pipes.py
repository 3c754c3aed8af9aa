"""The engine process's side of its pipes: one to each API-server process (`engine serve --api-server-count N`).

Every pipe carries the EngineLoop commands one way and the encoded events the other (engine_process.py). Pipe 0
is the main server's, the one that started the engine: its "stop" or its end stops the engine, and a SIGTERM the
engine process gets is reported there only. The other pipes belong to the extra API-server processes
(engine/server/api_servers.py), which share the listening socket; each request's events go back on the pipe
its "add" came in on, the counters (stats) go to every pipe, and a LoRA adapter loaded or unloaded through one
server is announced to the others, so that every `/v1/models` lists the same adapters. An extra server whose
pipe ends (it stopped, or died) has its open requests aborted: their KV pages are freed before the next step.

Request ids are unique across servers (each server draws them at random), so the routing needs no renaming.
"""

from __future__ import annotations

import logging
import signal
from collections import defaultdict
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.request import RequestOutput
from engine.server.engine_loop import Command
from engine.server.events_encoding import EncodedEvents, encode_error, encode_output
from engine.stats import EngineStats

logger = logging.getLogger("engine.server.engine_process")

MAIN = 0  # the main server's pipe


class TerminateRequest:
    """A SIGTERM the engine process got: its handler only notes it (it may interrupt a send on the pipe);
    the next receive tells the main server, which leads the shutdown (drains, then sends "stop")."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.reported = False

    def handle(self, signum: int, frame: object) -> None:
        self.signal = signal.Signals(signum).name


class EnginePipes(EncodedEvents):
    """The engine loop's command source (`receive`) and event sink over the API servers' pipes."""

    def __init__(self, conns: list[Connection], terminate: TerminateRequest) -> None:
        self.conns: dict[int, Connection] = dict(enumerate(conns))
        self.terminate = terminate
        self.origin: dict[str, int] = {}  # open request id (or LoRA ticket) -> the pipe it came in on
        self._lora_changes: dict[str, tuple[str, str, str | None]] = {}  # ticket -> (op, name, path)
        self.main_gone = False
        self._broken: list[int] = []  # pipes a send found closed, ended at the next receive

    # ---- commands in ------------------------------------------------------------------------
    def receive(self, timeout: float | None) -> list[Command]:
        """The commands that arrived on any pipe, waiting up to timeout for the first (None: not at all)."""
        if self.terminate.signal is not None and not self.terminate.reported:
            self.terminate.reported = True
            self._send_to(MAIN, ("terminate", self.terminate.signal))
        if self.main_gone:
            return [("stop",)]
        commands: list[Command] = []
        while self._broken:  # pipes a send found closed: their requests are aborted as for a pipe that ended
            commands += self._pipe_ended(self._broken.pop())
        for conn in wait(list(self.conns.values()), timeout or 0):
            index = next(i for i, c in self.conns.items() if c is conn)
            try:
                while conn.poll(0):
                    commands += self._note(index, conn.recv())
            except (EOFError, OSError):
                commands += self._pipe_ended(index)
        return commands

    def _note(self, index: int, command: Command) -> list[Command]:
        """The command as the loop runs it: an extra server's "fail_all" (its shutdown deadline) aborts its own
        requests only (it fails their streams itself), and only the main server stops the engine."""
        kind = command[0]
        if kind in ("add", "lora"):
            self.origin[command[1]] = index
        if kind == "lora":
            _, ticket, op, name, path = command
            self._lora_changes[ticket] = (op, name, path)
        elif kind == "abort":
            self.origin.pop(command[1], None)  # nothing more is reported for it
        if index != MAIN and kind == "fail_all":
            return [("abort", request_id) for request_id in self._forget_requests_of(index)]
        if index != MAIN and kind == "stop":
            logger.warning("API server %d sent stop: only the main server stops the engine", index)
            return []
        return [command]

    def _pipe_ended(self, index: int) -> list[Command]:
        """A server's pipe closed: the main server's stops the engine (it never outlives the server); another's
        requests are aborted, and nothing more is sent there."""
        conn = self.conns.pop(index, None)
        if conn is None:
            return []
        conn.close()
        if index == MAIN:
            self.main_gone = True
            return [("stop",)]
        orphans = self._forget_requests_of(index)
        logger.info("API server %d closed its pipe: %d of its requests aborted", index, len(orphans))
        return [("abort", request_id) for request_id in orphans]

    def _forget_requests_of(self, index: int) -> list[str]:
        """The open requests (and LoRA tickets) that came in on pipe `index`, no longer routed anywhere."""
        ids = [request_id for request_id, origin in self.origin.items() if origin == index]
        for request_id in ids:
            del self.origin[request_id]
            self._lora_changes.pop(request_id, None)
        return ids

    # ---- events out -------------------------------------------------------------------------
    def accepted(self, request_id: str, error: BaseException | None) -> None:
        index = self.origin.get(request_id)
        change = self._lora_changes.pop(request_id, None)
        if error is not None or change is not None:
            self.origin.pop(request_id, None)  # a refused add, or a LoRA change's answer: nothing more follows
        if index is not None:
            self._send_to(index, ("accepted", request_id, encode_error(error)))
        if change is not None and error is None:
            for other in list(self.conns):
                if other != index:
                    self._send_to(other, ("lora_changed", *change))

    def outputs(self, outputs: list[RequestOutput]) -> None:
        by_pipe: dict[int, list[tuple]] = defaultdict(list)
        for output in outputs:
            index = self.origin.get(output.request_id)
            if output.finished or output.error is not None:
                self.origin.pop(output.request_id, None)
            if index is not None:  # else its server's pipe ended: the request was aborted
                by_pipe[index].append(encode_output(output))
        for index, encoded in by_pipe.items():
            self._send_to(index, ("outputs", encoded))

    def failed(self, request_ids: list[str], error: BaseException) -> None:
        by_pipe: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            index = self.origin.pop(request_id, None)
            if index is not None:
                by_pipe[index].append(request_id)
        for index, ids in by_pipe.items():
            self._send_to(index, ("failed", ids, encode_error(error)))

    def stats(self, snapshot: EngineStats) -> None:
        for index in list(self.conns):
            self._send_to(index, ("stats", snapshot))

    def _send(self, message: tuple[Any, ...]) -> None:
        self._send_to(MAIN, message)

    def _send_to(self, index: int, message: tuple[Any, ...]) -> None:
        # A server that stopped closed its end first; what the loop reports while it winds down (the final
        # counters, the errors of what was open) has nobody left to read it, and is no error of the engine's.
        conn = self.conns.get(index)
        if conn is None or index in self._broken:
            return
        try:
            conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._broken.append(index)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
