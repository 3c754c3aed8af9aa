"""Connection limits uvicorn lacks: a deadline for each request head, and a cap on open connections.

uvicorn arms its keep-alive timer only after a response, so a socket that
connects and never sends a request (or sends its headers a byte a second:
slowloris) is held forever; 1,100 of them under a 1,024 descriptor limit
left new clients unanswered. This protocol closes a connection whose
request head is not complete within `header_timeout_s` of connecting (or of
its previous response) with a 408, and answers connections past
`max_connections` with a 503 and `Retry-After` straight away. `raise_fd_limit`
lifts the soft descriptor limit to the hard one at start-up, as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

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


REFUSE_503 = _raw_response(
    b"HTTP/1.1 503 Service Unavailable",
    json.dumps(error_body("too many open connections; retry later", 503)).encode(),
    b"retry-after: 1\r\n",
)
_TIMEOUT_408 = _raw_response(
    b"HTTP/1.1 408 Request Timeout", json.dumps(error_body("request head not received in time", 408)).encode()
)


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn takes a class for `http=`)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # bytes received since the head deadline was armed

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning("refusing a connection: %d open (limit %d)", len(self.connections), max_connections)
                transport.write(REFUSE_503)
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
            super().connection_lost(exc)

    return GuardedH11Protocol


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
