"""`engine serve`: build the engine, then run uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

logger = logging.getLogger("engine.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    group.add_argument("--port", type=int, default=30000)
    group.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes (or set ENGINE_API_KEY)")
    group.add_argument("--served-model-name", default=None, help="model id in the API (default: the model's file or folder name)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds to let running requests finish before aborting them")
    group.add_argument("--uvicorn-log-level", default="warning")
    group.add_argument(
        "--torch-threads", type=int, default=None,
        help="intra-op threads for the engine (default: torch's). On a small CPU box, one fewer than the "
        "cores leaves a core to the HTTP side (vLLM's CPU backend likewise reserves cores for its frontend)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.cli import engine_config_from_args
    from engine.engine import Engine
    from engine.server.app import API_KEY_ENV, build_app

    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        import torch

        torch.set_num_threads(args.torch_threads)  # before anything compiles or starts a thread pool
    start = time.perf_counter()
    engine = Engine(engine_config_from_args(args))
    logger.info("engine ready in %.1f s", time.perf_counter() - start)
    app = build_app(engine, args.served_model_name, args.api_key or os.environ.get(API_KEY_ENV))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=False,  # one debug line per request comes from our own middleware
        timeout_graceful_shutdown=max(0.0, args.shutdown_timeout),
    )
    server = uvicorn.Server(config)
    # Uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these
    # handlers in place that re-raise is a no-op, so a SIGTERM/SIGINT shutdown exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_shutdown)
    logger.info("listening on http://%s:%d", args.host, args.port)
    server.run()
    logger.info("server stopped")
    return 0


def _after_shutdown(signum: int, frame: object) -> None:
    logger.info("signal %d: shutdown already complete", signum)
