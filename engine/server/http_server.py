"""The HTTP side of `engine serve`: the app over an engine handle, behind uvicorn with the connection gate.

The main server process runs it (engine/server/launch.py), and so does every extra API-server process over the
same engine (engine/server/api_servers.py), each on the listening socket the main process bound.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.engine import Engine
from engine.structured.limits import GrammarLimits

if TYPE_CHECKING:
    from engine.server.connections import GatedServer
    from engine.server.engine_thread import EngineThread

logger = logging.getLogger("engine.server")


def serve_http(
    engine: Any,
    args: argparse.Namespace,
    engine_thread: EngineThread | None = None,
    sockets: Sequence[socket.socket] | None = None,
    index: int = 0,
    on_server: Callable[[GatedServer], None] | None = None,
) -> None:
    """Serve the app over `engine` (an Engine on `engine_thread`, or a handle on an engine elsewhere: an
    EngineProcess, a ReplicaSet, an api_servers.EngineClient) until shut down. sockets: listen there (bound by the
    main process) instead of binding args.host and args.port; index: the API server's number in the log;
    on_server: told the uvicorn server once it exists (to shut it down from elsewhere)."""
    import uvicorn

    from engine.server.app import API_KEY_ENV, ServerSettings, build_app
    from engine.server.connections import (
        ConnectionGate,
        GatedServer,
        connection_limits,
        guarded_protocol,
        raise_fd_limit,
    )

    settings = ServerSettings(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        open_metrics=args.open_metrics,
        enable_docs=args.enable_docs,
        allowed_hosts=allowed_hosts(args.allowed_hosts, args.host),
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        max_pending_requests=args.max_pending_requests,
        trust_request_chat_template=args.trust_request_chat_template,
        allow_unknown_fields=args.allow_unknown_fields,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        grammar_limits=GrammarLimits(
            args.grammar_max_chars, args.grammar_max_depth, args.grammar_compile_timeout, args.grammar_workers
        ),
    )
    app = build_app(engine, args.served_model_name, settings=settings, engine_thread=engine_thread)
    # Each connection holds a descriptor: lift the soft limit so the connection cap, not EMFILE, decides; the cap
    # and the listen backlog (accepted at once before the cap is seen) fit under it with room for the engine's files.
    fd_limit = raise_fd_limit(max(65536, 4 * args.max_connections))
    max_connections, backlog = connection_limits(fd_limit, args.max_connections)
    gate = ConnectionGate(max_connections, args.max_connections_per_address)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=False,  # one debug line per request comes from our own middleware
        timeout_graceful_shutdown=max(0.0, args.shutdown_timeout),
        timeout_keep_alive=args.timeout_keep_alive,
        http=guarded_protocol(gate, args.header_timeout),
        h11_max_incomplete_event_size=64 * 1024,  # request line + headers; larger gets a 400
        backlog=backlog,
        loop="asyncio",  # the connection gate pauses asyncio's listening sockets (engine/server/connections.py)
    )
    server = GatedServer(config, gate)
    app.state.uvicorn_server = server  # the shutdown watcher reads its should_exit and deadline
    if not isinstance(engine, Engine):
        engine.on_terminate = server.request_shutdown  # a SIGTERM the engine got: drain, then stop it
    # Uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these
    # handlers in place that re-raise is a no-op, so a SIGTERM/SIGINT shutdown exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_shutdown)
    if on_server is not None:
        on_server(server)
    logger.info(
        "%slistening on http://%s:%d (max %d connections, backlog %d, open-files limit %d, header timeout %.0f s, "
        "body limit %d bytes)",
        f"API server {index}: " if index else "",
        args.host,
        args.port,
        max_connections,
        backlog,
        fd_limit,
        args.header_timeout,
        args.max_body_bytes,
    )
    server.run(sockets=list(sockets) if sockets else None)
    logger.info("server stopped")


def _after_shutdown(signum: int, frame: object) -> None:
    logger.info("signal %d: shutdown already complete", signum)


def allowed_hosts(flag: str | None, bind_host: str) -> tuple[str, ...] | None:
    """The Host allow-list: as given, else loopback names for a loopback bind (DNS rebinding), else any."""
    from engine.server.guard import LOOPBACK_HOSTS

    if flag:
        hosts = tuple(h.strip().lower() for h in flag.split(",") if h.strip())
        return None if "*" in hosts else hosts
    if bind_host in LOOPBACK_HOSTS or bind_host.startswith("127."):
        return LOOPBACK_HOSTS + ((bind_host,) if bind_host not in LOOPBACK_HOSTS else ())
    return None
