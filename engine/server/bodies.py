"""Request bodies read and validated off the event loop, when they are large.

FastAPI parses a route's JSON body and validates it against its pydantic model on the event
loop: eight concurrent 8 MB token-id bodies held it for 6.2 s (issue #48), and /health,
every stream and every new request waited. Here the body is read as bytes (the guard's body
limits and timeout apply: a body that trickles in is a 408 with `Connection: close`, not
FastAPI's 400), and one larger than INLINE_BYTES is parsed on a thread of its own. Small
bodies, nearly every request, are parsed at once, so they never queue behind a large one.
Errors come out exactly as FastAPI's would: a RequestValidationError, which
engine/server/errors.py renders as a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from engine.server.protocol import NO_SURROGATES

INLINE_BYTES = 64 * 1024  # bodies up to this size are parsed on the loop (well under a millisecond)

M = TypeVar("M", bound=BaseModel)
# What a lone surrogate can come from in a UTF-8 body: a \uD800-\uDFFF escape, or the bytes of one (json.loads
# decodes bytes with "surrogatepass").
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class BodyParser:
    """Parses bodies into request models; large ones on its thread."""

    def __init__(self) -> None:
        # One thread: parsing holds the GIL anyway, and a queue of large bodies should delay only each other.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bodies")

    async def parse(self, raw: Request, model: type[M]) -> M:
        body = await raw.body()
        if len(body) <= INLINE_BYTES:
            return parse_body(body, model)
        return await asyncio.get_running_loop().run_in_executor(self._pool, parse_body, body, model)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_body(body: bytes, model: type[M]) -> M:
    """`model` from a JSON body, or the RequestValidationError FastAPI would have raised."""
    try:
        data: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _invalid_json(exc.msg, exc.pos) from exc
    except UnicodeDecodeError as exc:
        raise _invalid_json(f"the body is not UTF-8 ({exc.reason})", exc.start) from exc
    except RecursionError as exc:  # "[[[[..." deeper than the interpreter's stack
        raise _invalid_json("the body nests too deep", 0) from exc
    utf8 = b"\x00" not in body[:4] and not body.startswith((b"\xff\xfe", b"\xfe\xff"))  # json.loads' own test
    context = {NO_SURROGATES: True} if utf8 and not _SURROGATE.search(body) else None
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=data) from exc
    except RecursionError as exc:
        raise _invalid_json("the body nests too deep", 0) from exc


def _invalid_json(message: str, position: int) -> RequestValidationError:
    return RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error", "ctx": {"error": message}}]
    )
