"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every way a request can go wrong ends here with a 4xx (bad input) or, only for
bugs, a 500; the exception handlers below are what makes "never a 500 for bad
input" hold for FastAPI's own validation and routing errors too.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError
from engine.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error types by status (what its Python client maps to exception classes).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by route handlers; rendered by the handler registered in install_error_handlers."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.type = type_ or _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_response(
    message: str, status: int, param: str | None = None, type_: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(
            message=message, type=type_ or _TYPES.get(status, "InternalServerError"), param=param, code=status
        )
    )
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status >= 500:
        headers.setdefault("Connection", "close")  # the client should not reuse a connection after a server error
    return JSONResponse(body.model_dump(), status_code=status, headers=headers or None)


def error_body(message: str, status: int = 500) -> dict:
    """The error shape as a dict, for an SSE event when a stream fails after its headers are sent."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=_TYPES.get(status, "InternalServerError"), code=status)
    ).model_dump()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for error in exc.errors():
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            return "request body is not valid JSON: " + str(error.get("ctx", {}).get("error", error.get("msg"))), None
        where = ".".join(location)
        param = param or (location[0] if location else None)
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.type, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI (and vLLM) answer 400 for a malformed body.
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "Error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(message, exc.status_code)

    # Anything else is a bug: GuardMiddleware (engine/server/guard.py) answers it with a JSON 500.
