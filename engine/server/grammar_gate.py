"""A request's grammar is judged before the request is admitted to the engine.

The verdict comes from the compiler processes (engine/structured/checker.py): the grammar parses,
compiles within the deadline and can match some text, or the request is a 400 naming its field, sent
before any header (streaming too). Nothing here runs on a thread that other requests share: the
handler waits on the event loop for the verdict or its client's disconnect (engine/server/disconnects.py),
and a client that leaves releases its check, which stops (its worker killed) if no other request waits for
the same grammar.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request

from engine.errors import InvalidRequestError
from engine.server.disconnects import client_gone
from engine.server.errors import APIError
from engine.structured.checker import GrammarChecker
from engine.structured.pool import GrammarWorkerError
from engine.structured.spec import GrammarSpec


async def await_verdict(checker: GrammarChecker, spec: GrammarSpec, field: str, raw: Request) -> None:
    """Return once the grammar is fine; APIError 400 (refused, naming `field`), 499 (the client left) or 503."""
    ticket = checker.check(spec)
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()

    def wake(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed first (shutdown): nobody waits any more
            loop.call_soon_threadsafe(ready.set)

    verdict = asyncio.ensure_future(ready.wait())
    gone = asyncio.ensure_future(client_gone(raw))
    try:
        ticket.future.add_done_callback(wake)
        await asyncio.wait({verdict, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not ticket.future.done():
            raise APIError("client disconnected", status=499)
        if ticket.future.cancelled():
            raise APIError("the server is shutting down", status=503)
        ticket.future.result()
    except InvalidRequestError as exc:
        raise APIError(f"{field}: {exc}", param=field) from exc
    except GrammarWorkerError as exc:
        raise APIError(str(exc), status=503, headers={"Retry-After": "1"}) from exc
    finally:
        verdict.cancel()
        gone.cancel()
        ticket.release()
