"""The server's front door, as pure ASGI middleware: auth, host check and body limits before any work.

Pure ASGI, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware
wraps `receive`, and under it a disconnect never reaches the app (engine/server/disconnects.py),
so a non-streaming request whose client left ran to its end. Here the
app's `receive` is the server's own (wrapped only to count body bytes), and:

- the API key is checked from the headers, before a byte of the body is
  read, on every route but /health (and /metrics when the operator opens it);
- the Host header is checked against an allow-list (DNS rebinding of a
  loopback server); an HTTP/1.0 request may leave it out (HAProxy's default
  health check does, and the browsers that DNS rebinding needs always send it);
- a body larger than the limit is a 413 from its Content-Length alone, or
  as soon as a chunked body passes the limit; a body that trickles in more
  slowly than the body timeout is a 408;
- an unexpected error becomes a JSON 500 with `Connection: close`, so the
  client knows the connection ends (uvicorn drops it after an exception);
- at shutdown (`OpenRequests.end`, just before uvicorn's graceful deadline), a
  request with no response yet (tokenizing, waiting for its grammar's check or
  for the engine) is cancelled and answered with a JSON 503, where uvicorn
  would cancel it at the deadline with a plain-text 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.server.errors import error_body

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class OpenRequests:
    """The requests that have not started their response, so that shutdown can answer them (a JSON 503)."""

    def __init__(self) -> None:
        self.waiting: set[asyncio.Task[Any]] = set()
        self.ending: str | None = None  # set once shutdown has begun: the 503's message

    def end(self, message: str) -> None:
        self.ending = message
        for task in list(self.waiting):
            task.cancel()


@dataclass
class GuardSettings:
    api_key: str | None = None
    open_paths: frozenset[str] = frozenset({"/health"})  # answered without the key
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header
    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 10.0
    open_requests: OpenRequests = field(default_factory=OpenRequests)


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: GuardSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope.get("headers", [])}
        path = scope.get("path", "")
        rejection = self._reject_before_body(path, headers, scope.get("http_version", "1.1"))
        if rejection is not None:
            status, message, extra = rejection
            # The body is left unread, so the connection cannot carry another request: say so.
            has_body = headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers
            await _send_error(send, status, message, extra, close=has_body)
            return
        started = {"response": False, "status": 0}
        open_requests = self.settings.open_requests
        task = asyncio.current_task()
        assert task is not None

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started["response"], started["status"] = True, int(message["status"])
                open_requests.waiting.discard(task)
            await send(message)

        open_requests.waiting.add(task)
        try:
            await self.app(scope, self._limited_receive(receive), tracking_send)
        except asyncio.CancelledError:
            if open_requests.ending is None or started["response"]:
                raise  # not ours: uvicorn's own cancellation
            await _send_error(send, 503, open_requests.ending, close=True)
        except _BodyTooLarge:
            if not started["response"]:
                await _send_error(send, 413, f"request body exceeds {self.settings.max_body_bytes} bytes", close=True)
        except TimeoutError:
            if not started["response"]:
                await _send_error(
                    send, 408, f"request body not received within {self.settings.body_timeout_s:g} s", close=True
                )
        except Exception:
            logger.exception("unexpected error serving %s %s", scope.get("method"), path)
            if not started["response"]:
                await _send_error(send, 500, "internal server error", close=True)
        finally:
            open_requests.waiting.discard(task)
        logger.debug(
            "%s %s -> %d (%.1f ms)", scope.get("method"), path, started["status"], 1000 * (time.perf_counter() - start)
        )

    def _reject_before_body(
        self, path: str, headers: dict[str, str], http_version: str
    ) -> tuple[int, str, dict[str, str]] | None:
        settings = self.settings
        host = headers.get("host")
        if settings.allowed_hosts is not None:
            if host is None and http_version != "1.0":
                return 400, "missing Host header", {}
            if host is not None and not host_allowed(host, settings.allowed_hosts):
                return 400, "invalid Host header", {}
        if settings.api_key is not None and path not in settings.open_paths:
            header = headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            # Constant-time compare: the key must not leak through response timing.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
                return (
                    401,
                    "invalid or missing API key (send Authorization: Bearer <key>)",
                    {"www-authenticate": "Bearer"},
                )
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return 400, "invalid Content-Length header", {}
            if int(length) > settings.max_body_bytes:
                return 413, f"request body of {int(length)} bytes exceeds the limit of {settings.max_body_bytes}", {}
        return None

    def _limited_receive(self, receive: Receive) -> Receive:
        limit, timeout = self.settings.max_body_bytes, self.settings.body_timeout_s
        state = {"bytes": 0, "deadline": None}

        async def limited() -> Message:
            if state["deadline"] is None:
                state["deadline"] = time.monotonic() + timeout
            remaining = state["deadline"] - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            message = await receive() if remaining == float("inf") else await asyncio.wait_for(receive(), remaining)
            if message["type"] == "http.request":
                state["bytes"] += len(message.get("body", b""))
                if state["bytes"] > limit:
                    raise _BodyTooLarge
                if not message.get("more_body", False):
                    # The body is complete: from here on receive() only waits for a disconnect.
                    state["deadline"] = float("inf")
            return message

        return limited


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """Host header (with or without a port, IPv6 in brackets) against an allow-list ('*' allows any)."""
    if "*" in allowed:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host in allowed


async def _send_error(
    send: Send, status: int, message: str, extra: dict[str, str] | None = None, close: bool = False
) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    if close or status in (408, 413, 500):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
