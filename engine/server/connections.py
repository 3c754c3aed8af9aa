"""Connection limits uvicorn lacks: a deadline for each request head, and a cap on open connections.

uvicorn arms its keep-alive timer only after a response, so a socket that
connects and never sends a request (or sends its headers a byte a second:
slowloris) is held forever; 1,100 of them under a 1,024 descriptor limit
left new clients unanswered. This protocol closes a connection whose
request head is not complete within `header_timeout_s` of connecting (or of
the first byte of its next request) with a 408.

The cap (`ConnectionGate`) holds without ever running out of descriptors, and
idle sockets never lock anyone out:

- at the cap, a new connection takes the place of the oldest *idle* one (no
  request in progress: silent since it connected, part-way through a head, or
  kept alive after a response), which is closed; so however many idle sockets
  a client opens, a new client's request is served at once. A connection whose
  request bytes are already waiting unread (accepted in the same wake-up, not
  yet read) is not idle, and is passed over; when none is idle, the newcomer
  gets a 503;
- when every connection has a request in progress, the server stops accepting
  (the listening sockets leave the event loop) until one ends: new clients wait
  in the kernel's listen backlog instead of costing a descriptor each. asyncio
  accepts up to `backlog` connections per wake-up before any of them is seen, so
  the descriptors in use stay under the cap plus the backlog (launch.py sizes
  both under the open-files limit); the few accepted past the cap get a 503;
- with `max_per_address`, connections past that many from one address get a
  503 at once (off by default: behind a proxy every client shares its address).

`raise_fd_limit` lifts the soft descriptor limit to the hard one at start-up, as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from collections import Counter
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server.errors import error_body

logger = logging.getLogger(__name__)


def _raw_response(status_line: bytes, body: bytes, headers: bytes = b"") -> bytes:
    return (
        status_line
        + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + headers
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _refusal(message: str) -> bytes:
    return _raw_response(
        b"HTTP/1.1 503 Service Unavailable", json.dumps(error_body(message, 503)).encode(), b"retry-after: 1\r\n"
    )


REFUSE_503 = _refusal("too many open connections; retry later")
REFUSE_ADDRESS_503 = _refusal("too many open connections from your address; retry later")
_TIMEOUT_408 = _raw_response(
    b"HTTP/1.1 408 Request Timeout", json.dumps(error_body("request head not received in time", 408)).encode()
)


EVICT_CANDIDATES = 32  # idle connections looked at (oldest first) for one without unread request bytes


class ConnectionGate:
    """The open connections of one server: counted per address, idle ones in the order they went idle."""

    def __init__(self, max_connections: int, max_per_address: int = 0) -> None:
        self.max_connections = max_connections
        self.max_per_address = max_per_address  # 0: no limit
        self.open: set[H11Protocol] = set()
        self.by_address: Counter[str] = Counter()
        self.idle: dict[H11Protocol, None] = {}  # insertion order: the oldest idle connection first
        self.servers: list[asyncio.base_events.Server] = []  # the listening servers, once uvicorn has started
        self.paused = False
        self.evicted = 0  # idle connections closed to make room
        self.refused = 0  # connections answered 503 (per-address limit, or past the cap)
        self._warned_at = 0.0

    def admit(self, protocol: H11Protocol, address: str) -> bytes | None:
        """Register a new connection, making room if need be; the refusal to send it instead, if any."""
        refusal = self._admit(protocol, address)
        if refusal is not None:
            self.refused += 1
            now = time.monotonic()
            if now - self._warned_at > 1.0:  # a flood would otherwise log a line per connection
                self._warned_at = now
                logger.warning(
                    "refusing connections (%d so far; %d open, %d from %s)",
                    self.refused,
                    len(self.open),
                    self.by_address[address],
                    address,
                )
        return refusal

    def _admit(self, protocol: H11Protocol, address: str) -> bytes | None:
        if self.max_per_address and self.by_address[address] >= self.max_per_address:
            return REFUSE_ADDRESS_503
        if len(self.open) >= self.max_connections:
            if not self.idle:
                self._pause()
                return REFUSE_503  # accepted in the same wake-up as the connection that filled the cap
            victim = next((p for _, p in zip(range(EVICT_CANDIDATES), self.idle) if not _has_unread_bytes(p)), None)
            if victim is None:
                return REFUSE_503  # the idle ones all have a request waiting to be read
            self.forget(victim)
            self.evicted += 1
            victim.transport.close()
        self.open.add(protocol)
        self.by_address[address] += 1
        self.idle[protocol] = None
        return None

    def busy(self, protocol: H11Protocol) -> None:
        """A request is in progress on the connection: it is not evicted for a newcomer."""
        self.idle.pop(protocol, None)
        if len(self.open) >= self.max_connections and not self.idle:
            self._pause()

    def went_idle(self, protocol: H11Protocol) -> None:
        if protocol in self.open:
            self.idle.pop(protocol, None)
            self.idle[protocol] = None  # to the end: the most recently idle
            self._resume()

    def forget(self, protocol: H11Protocol) -> None:
        if protocol not in self.open:
            return
        self.open.discard(protocol)
        self.idle.pop(protocol, None)
        address = _address(protocol)
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]
        self._resume()

    def _pause(self) -> None:
        """Stop accepting: the listening sockets leave the event loop (newcomers wait in the listen backlog)."""
        if self.paused or not self.servers:
            return
        loop = asyncio.get_running_loop()
        for server in self.servers:
            for sock in server.sockets:
                loop.remove_reader(sock.fileno())
            server._serving = False  # so that _start_serving adds them back
        self.paused = True
        logger.warning("%d connections open, each with a request in progress: not accepting more", len(self.open))

    def _resume(self) -> None:
        if self.paused and (len(self.open) < self.max_connections or self.idle):
            for server in self.servers:
                server._start_serving()
            self.paused = False


def _has_unread_bytes(protocol: H11Protocol) -> bool:
    """Whether the client has sent bytes the server has not read yet (a request about to be seen)."""
    sock = protocol.transport.get_extra_info("socket")
    if sock is None:
        return False
    view = socket.socket(fileno=sock.fileno())  # a view of the same descriptor, detached (not closed) after
    try:
        return bool(view.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:
        return False  # nothing to read (EAGAIN), or the connection is broken: idle either way
    finally:
        view.detach()


def _address(protocol: H11Protocol) -> str:
    client = getattr(protocol, "client", None)
    return str(client[0]) if client else ""


def guarded_protocol(gate: ConnectionGate, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn takes a class for `http=`)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # bytes received since the head deadline was armed

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            refusal = gate.admit(self, _address(self))
            if refusal is not None:
                transport.write(refusal)
                transport.close()
                return
            self._arm_head_timer()  # a new connection must send a whole request head in time

        def data_received(self, data: bytes) -> None:
            between_requests = self.cycle is None or self.cycle.response_complete
            if between_requests and self._head_timer is None:
                self._arm_head_timer()  # the next request on a keep-alive connection: the same deadline
            self._head_bytes += len(data)
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_head_timer()  # a request head arrived: the body has its own timeout
                gate.busy(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                gate.went_idle(self)  # kept alive, waiting for its next request

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            if self._head_bytes:
                # Part of a request came in (slowloris): say why before closing.
                logger.debug("closing a connection whose request head took over %.0f s", header_timeout_s)
                self.transport.write(_TIMEOUT_408)
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            gate.forget(self)
            super().connection_lost(exc)

    return GuardedH11Protocol


class GatedServer(uvicorn.Server):
    """uvicorn's server, handing its listening servers to the gate once they exist (so it can pause them)."""

    def __init__(self, config: uvicorn.Config, gate: ConnectionGate) -> None:
        super().__init__(config)
        self.gate = gate

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        self.gate.servers = list(getattr(self, "servers", []))

    def request_shutdown(self) -> None:
        """The graceful shutdown a SIGTERM starts (from any thread: uvicorn's loop polls the flag)."""
        self.should_exit = True


def raise_fd_limit(target: int = 65536) -> int:
    """Lift the soft open-files limit towards `target` (never above the hard limit); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return soft


FD_RESERVE = 256  # descriptors kept for the engine, its processes, logs and model files


def connection_limits(fd_limit: int, max_connections: int) -> tuple[int, int]:
    """(connection cap, listen backlog) whose sum stays under the open-files limit, less FD_RESERVE: asyncio
    accepts up to a backlog of connections at a time before the cap is checked."""
    room = max(64, fd_limit - FD_RESERVE)
    backlog = max(16, min(2048, room // 4))
    return max(16, min(max_connections, room - backlog)), backlog
