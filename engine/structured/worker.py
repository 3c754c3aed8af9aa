"""A grammar compiler process: parses and compiles request grammars, one at a time, for the pool
(engine/structured/pool.py), which kills it when a grammar passes the deadline or nobody waits for it.

Imported by the fork server (the pool's process factory), so xgrammar, and torch under it, are loaded
once there and every replacement worker starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing.connection import Connection

from engine.errors import InvalidRequestError
from engine.structured.spec import GrammarSpec, compile_spec, import_xgrammar, xgrammar_message

with contextlib.suppress(ImportError):  # loaded into the fork server now, not in each worker
    import xgrammar  # noqa: F401

NICE = 10  # grammar work yields the CPU to the engine and the HTTP side


def serve(conn: Connection, tokenizer_info_json: str) -> None:
    """Worker main: ("ready",) once, then for each (job_id, GrammarSpec) received, (job_id, None) if it
    compiled and can match some text, else (job_id, the message of a 400). Returns when the pipe closes."""
    # Ctrl-C and SIGTERM reach the process group: the server decides (fork_server_signals.py, for the spawn case).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    xgr = import_xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the pool's cache is by spec
    # The pool may close the pipe at any moment (the server shutting down while this worker starts or
    # compiles): a worker whose pipe is gone ends quietly, never with a traceback in the server's log.
    with contextlib.suppress(EOFError, OSError):
        conn.send(("ready",))
        while True:
            job_id, spec = conn.recv()
            conn.send((job_id, _verdict(compiler, spec)))


def _verdict(compiler: object, spec: GrammarSpec) -> str | None:
    """None if the spec compiles and can match some text, else the message of its 400."""
    try:
        compile_spec(compiler, spec)
    except InvalidRequestError as exc:
        return str(exc)
    except Exception as exc:  # xgrammar failing another way: still this grammar's problem
        return f"the {spec.describe()} could not be compiled: {xgrammar_message(exc)}"
    return None
