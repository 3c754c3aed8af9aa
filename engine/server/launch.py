"""`engine serve`: build the engine, then run uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import socket
import time

from engine.server.prefix_routing import POLICIES
from engine.server.tool_parsers import PARSERS
from engine.structured.limits import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_DEPTH,
    DEFAULT_WORKERS,
)

logger = logging.getLogger("engine.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    group.add_argument("--port", type=int, default=30000)
    group.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes (or set ENGINE_API_KEY)"
    )
    group.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: the model's file or folder name)"
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds to let running requests finish before aborting them",
    )
    group.add_argument("--uvicorn-log-level", default="warning")
    add_data_parallel_args(parser)
    limits = parser.add_argument_group("server limits and access (docs/server.md)")
    limits.add_argument(
        "--max-connections",
        type=int,
        default=2048,
        help="open connections at most (lowered to fit the open-files limit, which is raised first): at the cap a "
        "new connection replaces the oldest idle one; with none idle, new ones wait in the listen backlog",
    )
    limits.add_argument(
        "--max-connections-per-address",
        type=int,
        default=0,
        help="open connections from one client address at most; more get a 503 (0: no limit, the default, since "
        "behind a proxy every client has the proxy's address)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a complete request head (slowloris, idle sockets)",
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=30.0,
        help="idle seconds before a keep-alive connection closes; longer than clients' own pool expiry (httpx 5 s, "
        "aiohttp 15 s), so a client never reuses a connection the server is closing (a dropped request)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=10.0,
        help="seconds a request body may take to arrive (a 408 with Connection: close after)",
    )
    limits.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get a 413, unread")
    limits.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="engine requests (prompts x n) in flight; more get a 503 with Retry-After",
    )
    limits.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header values accepted (default: loopback names when bound to "
        "loopback, any otherwise; '*' for any)",
    )
    limits.add_argument("--open-metrics", action="store_true", help="serve /metrics without the API key")
    limits.add_argument(
        "--enable-docs", action="store_true", help="serve /docs and /openapi.json (behind the key if one is set)"
    )
    limits.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="ignore request fields this server does not know instead of answering 400 "
        "(fields of unimplemented features, such as logit_bias, are refused either way)",
    )
    limits.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,  # engine/server/tool_parsers.py
        help='read tool calls out of the model\'s text for tool_choice "auto" (hermes: Qwen 2.5/3 '
        'and Hermes; llama3_json: Llama 3.x; mistral; glm45: GLM-4.5/4.6); "required" and named '
        "functions are forced by a grammar and need no parser",
    )
    limits.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        default=None,  # engine/server/reasoning.py
        help="split <think>...</think> into reasoning_content (deepseek_r1: the template opens the "
        "thought; qwen3: the model does)",
    )
    limits.add_argument(
        "--grammar-max-chars",
        type=int,
        default=DEFAULT_MAX_CHARS,
        help="longer structured-output schemas, regexes and grammars get a 400 before anything parses them",
    )
    limits.add_argument(
        "--grammar-max-depth",
        type=int,
        default=DEFAULT_MAX_DEPTH,
        help="a schema nesting deeper (JSON levels; parentheses of a regex or EBNF) gets a 400 before parsing",
    )
    limits.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        help="CPU seconds a request grammar may take to parse and compile; its compiler process is killed then and "
        'the request gets a 400 "grammar too complex"',
    )
    limits.add_argument(
        "--grammar-workers",
        type=int,
        default=DEFAULT_WORKERS,
        help="compiler processes that check request grammars (at nice +10), so that one slow grammar delays no other",
    )
    limits.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests supply their own chat template through chat_template_kwargs",
    )
    group.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine in a process of its own, so the HTTP side never holds the GIL its step loop needs "
        "(default: on for accelerators, off on the CPU, where two cores gain nothing from a second process)",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP server processes over the one engine process, sharing the listening socket (vLLM's flag): "
        "parsing, tokenizing and streaming for many clients spread over as many cores (needs the engine in its "
        "own process; not with --data-parallel-size)",
    )
    group.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="intra-op threads for the engine (default: torch's). On a small CPU box, one fewer than the "
        "cores leaves a core to the HTTP side (vLLM's CPU backend likewise reserves cores for its frontend)",
    )


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallelism (docs/server.md#data-parallel-replicas)")
    group.add_argument(
        "--data-parallel-size",
        "--dp-size",
        type=int,
        default=1,
        help="engine replicas behind this endpoint, each in its own process on its own GPU (on the CPU: its own "
        "block of cores), with a router choosing one per request",
    )
    group.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray"),
        default="mp",
        help="where the replicas run: mp, processes of this host; ray, actors on a Ray cluster (RAY_ADDRESS, or a "
        "local one), one per placement-group bundle of a GPU or --torch-threads CPUs",
    )
    group.add_argument(
        "--router-policy",
        choices=POLICIES,
        default="cache_aware",
        help="how the router picks a replica: the one holding the longest prefix of the prompt unless the load "
        "is out of balance (SGLang's cache_aware), in turn, or the one with the fewest requests",
    )
    group.add_argument(
        "--router-cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: the share of the prompt a replica's cached prefix must cover to be chosen for it",
    )
    group.add_argument(
        "--router-balance-abs-threshold",
        type=int,
        default=32,
        help="cache_aware: requests the busiest replica may hold over the idlest before the idlest takes the next",
    )
    group.add_argument(
        "--router-balance-rel-threshold",
        type=float,
        default=1.0001,
        help="cache_aware: ... and the ratio of their counts that must also be passed",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.api_servers import ApiServers, prepare_shared_metrics

    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        if args.engine_process is False:
            raise ValueError("--api-server-count > 1 serves the engine in its own process: drop --no-engine-process")
        if args.data_parallel_size != 1 or args.distributed_executor_backend == "ray":
            raise ValueError("--api-server-count > 1 with --data-parallel-size is not supported yet: choose one")
        prepare_shared_metrics()  # before anything imports prometheus_client
    from engine.cli import engine_config_from_args
    from engine.engine import Engine
    from engine.server.engine_process import EngineProcess, Placement
    from engine.server.engine_thread import EngineThread
    from engine.server.http_server import serve_http
    from engine.server.prefix_routing import RoutingPolicy
    from engine.server.replicas import ReplicaSet, placements

    for name in ("max_connections", "max_body_bytes", "max_pending_requests", "grammar_max_chars", "grammar_max_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.grammar_workers < 1:
        raise ValueError(f"--grammar-workers must be >= 1, got {args.grammar_workers}")
    if args.max_connections_per_address < 0:
        raise ValueError(f"--max-connections-per-address must be >= 0, got {args.max_connections_per_address}")
    for name in ("header_timeout", "timeout_keep_alive", "body_timeout", "grammar_compile_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")

    if args.torch_threads is not None and args.torch_threads < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    start = time.perf_counter()
    config = engine_config_from_args(args, freeze_gc=args.freeze_gc is not False)  # one engine for the server's life
    from backends import get_platform

    platform = get_platform(config.device)
    use_process = args.engine_process
    if use_process is None:
        use_process = platform.serve_engine_in_own_process
    engine: Engine | EngineProcess | ReplicaSet
    engine_thread = None
    if args.data_parallel_size != 1 or args.distributed_executor_backend == "ray":
        if args.engine_process is False:
            raise ValueError("--data-parallel-size runs each replica in a process of its own: drop --no-engine-process")
        policy = RoutingPolicy(
            args.router_policy,
            args.router_cache_threshold,
            args.router_balance_abs_threshold,
            args.router_balance_rel_threshold,
        )
        if args.distributed_executor_backend == "ray":
            if platform.replica_share is None:
                raise ValueError(f"--distributed-executor-backend ray runs cuda and cpu replicas; not {platform.name}")
            # Ray places the replicas (a bundle each) and gives each actor its GPU.
            if args.data_parallel_size < 1:
                raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
            threads = args.torch_threads or 1
            shares = [Placement(torch_threads=threads, name=f"engine {i}") for i in range(args.data_parallel_size)]
            # A bundle per replica: its tensor-parallel ranks' GPUs (the actor spawns the ranks beside itself).
            gpus = config.tensor_parallel_size if platform.replica_share == "devices" else 0
            engine = ReplicaSet(config, shares, policy, backend="ray", gpus_per_replica=gpus)
        else:
            shares = placements(platform, args.data_parallel_size, args.torch_threads, config.tensor_parallel_size)
            engine = ReplicaSet(config, shares, policy)
        engine.start()
        use_process = True
    elif use_process or args.api_server_count > 1:
        use_process = True
        engine = EngineProcess(config, args.torch_threads, api_servers=args.api_server_count)
        engine.start()
    else:
        if args.torch_threads is not None:
            import torch

            torch.set_num_threads(args.torch_threads)  # before anything compiles or starts a thread pool
        # Built on the thread that will step it: one OpenMP team in the process (engine_thread.py says why).
        engine_thread = EngineThread()
        engine = engine_thread.call(lambda: Engine(config))
    logger.info(
        "engine ready in %.1f s (%s)",
        time.perf_counter() - start,
        "its own process" if use_process else "a thread of the server process",
    )
    if args.api_server_count == 1:
        serve_http(engine, args, engine_thread)
        return 0
    assert isinstance(engine, EngineProcess) and engine.info is not None
    listening = bind_listening_socket(args.host, args.port)
    api_servers = ApiServers()
    api_servers.start(args, engine.info, engine.api_pipes, listening)
    engine.before_stop = api_servers.stop  # they drain before the engine stops
    serve_http(engine, args, sockets=[listening])
    return 0


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The socket every API-server process listens on (uvicorn's own binding: address reuse, inheritable)."""
    import uvicorn

    return uvicorn.Config(app=None, host=host, port=port).bind_socket()
