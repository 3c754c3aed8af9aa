"""Connections (issue #48, item 3), on a uvicorn server in this process with small limits.

The connection cap holds without accepting past it (the listening socket leaves the event loop when every
connection is busy), idle sockets give their place to a newcomer, one address may hold at most so many
connections, a body that trickles in is a 408 with `Connection: close`, and an HTTP/1.0 health check without a
Host header (HAProxy's default) is answered.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from server_helpers import free_port

from engine.engine import Engine
from engine.server.app import ServerSettings, build_app
from engine.server.connections import ConnectionGate, GatedServer, guarded_protocol
from engine.server.guard import LOOPBACK_HOSTS

CAP = 8
BACKLOG = 16


class InProcessServer:
    def __init__(self, engine: Engine, per_address: int = 0) -> None:
        settings = ServerSettings(body_timeout_s=0.5, allowed_hosts=LOOPBACK_HOSTS)
        self.app = build_app(engine, settings=settings)
        self.release = threading.Event()

        @self.app.get("/slow")
        async def slow() -> dict[str, str]:  # a request in progress until the test releases it
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            return {"ok": "yes"}

        self.port = free_port()
        self.gate = ConnectionGate(CAP, per_address)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            http=guarded_protocol(self.gate, 2.0),
            backlog=BACKLOG,
            loop="asyncio",
            log_level="warning",
            timeout_keep_alive=30,
        )
        self.server = GatedServer(config, self.gate)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connections(self) -> int:
        return len(self.server.server_state.connections)


@pytest.fixture
def served(smol_engine: Engine) -> Iterator[InProcessServer]:
    with InProcessServer(smol_engine) as server:
        yield server


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_response(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_idle_sockets_give_their_place_to_a_newcomer(served: InProcessServer) -> None:
    idle = [_connect(served.port) for _ in range(3 * CAP)]  # silent: no request ever
    try:
        time.sleep(0.3)
        start = time.monotonic()
        response = httpx.get(f"{served.base}/health", timeout=5)
        assert response.status_code == 200 and time.monotonic() - start < 1.0
        assert served.gate.evicted >= 2 * CAP  # each newcomer past the cap closed the oldest idle socket
        assert served.connections() <= CAP
    finally:
        for sock in idle:
            sock.close()


def test_past_the_cap_with_every_connection_busy_nothing_more_is_accepted(served: InProcessServer) -> None:
    """Eight requests in progress fill the cap: the listening socket is paused, so a burst of 200 connects
    waits in the kernel's backlog instead of costing a descriptor each; once the requests end, a new client is
    served."""
    with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=CAP + 1)) as client:
        results: list[Any] = []
        busy = [
            threading.Thread(target=lambda: results.append(client.get(f"{served.base}/slow").status_code))
            for _ in range(CAP)
        ]
        for thread in busy:
            thread.start()
        deadline = time.monotonic() + 10
        while not served.gate.paused:
            assert time.monotonic() < deadline, f"not paused at the cap: {served.connections()} open"
            time.sleep(0.01)
        burst = []
        for _ in range(200):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", served.port))
            burst.append(sock)
        time.sleep(0.5)
        # Not accepted at all: none of the burst got a descriptor, and so none a 503 either.
        assert served.connections() == CAP and served.gate.refused == 0, (served.connections(), served.gate.refused)
        for sock in burst:
            sock.close()
        served.release.set()
        for thread in busy:
            thread.join(30)
    assert results == [200] * CAP
    start = time.monotonic()
    assert httpx.get(f"{served.base}/health", timeout=10).status_code == 200
    assert time.monotonic() - start < 1.0
    assert not served.gate.paused


def test_connections_per_address_are_capped(smol_engine: Engine) -> None:
    with InProcessServer(smol_engine, per_address=3) as served:
        held = [_connect(served.port) for _ in range(3)]
        try:
            extra = _connect(served.port)
            answer = _read_response(extra)
            extra.close()
            assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
            assert b"too many open connections from your address" in answer
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{served.base}/health", timeout=5).status_code == 200


def test_a_body_that_trickles_in_is_a_408_that_closes_the_connection(served: InProcessServer) -> None:
    """Issue #48: a slow body got FastAPI's 400 ("There was an error parsing the body") without
    `Connection: close`, where the docs promise a 408."""
    sock = _connect(served.port)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        answer = _read_response(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert b"connection: close" in head and b"request body not received within 0.5 s" in answer


def test_http_1_0_health_check_without_host_is_answered(served: InProcessServer) -> None:
    """HAProxy's default check is `GET /health HTTP/1.0` with no Host header: it got a 400."""
    sock = _connect(served.port)
    try:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        answer = _read_response(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    # HTTP/1.1 still needs a Host header, and a foreign one is refused either way.
    sock = _connect(served.port)
    try:
        sock.sendall(b"GET /health HTTP/1.0\r\nHost: evil.example\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 400")
    finally:
        sock.close()
