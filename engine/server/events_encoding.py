"""The engine's events as plain tuples, for a pipe or a Ray call, and back (EngineEvents across a process).

A streamed output carries its deltas only; the final one carries the whole text, token ids and logprobs once
(what a non-streaming response needs). Errors travel as (class name, message) and come back as the engine's
error classes.
"""

from __future__ import annotations

import abc
from typing import Any

from engine.errors import (
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    RequestFailedError,
    UnsupportedArchitectureError,
)
from engine.request import RequestOutput
from engine.server.engine_loop import EngineDeadError
from engine.server.streams import StreamRouter
from engine.stats import EngineStats

_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        EngineError,
        InvalidRequestError,
        ModelLoadError,
        UnsupportedArchitectureError,
        RequestFailedError,
        EngineDeadError,
    )
}


def encode_error(error: BaseException | None) -> tuple[str, str] | None:
    return None if error is None else (type(error).__name__, str(error))


def decode_error(encoded: tuple[str, str] | None) -> BaseException | None:
    if encoded is None:
        return None
    name, message = encoded
    cls = _ERRORS.get(name)
    return cls(message) if cls is not None else RuntimeError(f"{name}: {message}")


def encode_output(output: RequestOutput) -> tuple:
    final = (output.text, output.token_ids, output.logprobs) if output.finished else None
    # Prompt logprobs (echo) are whole with every output: the server reads them from a request's first output
    # (a stream's echo) and its last (a whole response), so only those carry them across the pipe.
    first = len(output.token_ids) <= 1
    return (
        output.request_id,
        output.new_token_ids,
        output.new_text,
        output.finish_reason,
        output.new_logprobs,
        output.prompt_logprobs if first or output.finished else None,
        output.error,
        final,
    )


def decode_output(item: tuple) -> RequestOutput:
    request_id, new_token_ids, new_text, finish_reason, new_logprobs, prompt_logprobs, error, final = item
    text, token_ids, logprobs = final if final is not None else ("", [], None)
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        token_ids=token_ids,
        text=text,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        new_token_ids=new_token_ids,
        new_text=new_text,
        logprobs=logprobs,
        new_logprobs=new_logprobs,
        prompt_logprobs=prompt_logprobs,
        error=error,
    )


def deliver_event(message: tuple[Any, ...], router: StreamRouter) -> None:
    """One of the engine's events, as EncodedEvents wrote it, to the server's router."""
    kind = message[0]
    if kind == "outputs":
        router.outputs([decode_output(item) for item in message[1]])
    elif kind == "accepted":
        router.accepted(message[1], decode_error(message[2]))
    elif kind == "failed":
        router.failed(message[1], decode_error(message[2]) or EngineDeadError("failed"))
    elif kind == "stats":
        router.stats(message[1])
    elif kind == "lora_changed":
        router.on_lora_change(*message[1:])
    else:
        raise ValueError(f"unknown engine event {kind!r}")


class EncodedEvents(abc.ABC):
    """EngineEvents as plain tuples (what crosses a pipe or a Ray call; deliver_event reads them back)."""

    def accepted(self, request_id: str, error: BaseException | None) -> None:
        self._send(("accepted", request_id, encode_error(error)))

    def outputs(self, outputs: list[RequestOutput]) -> None:
        self._send(("outputs", [encode_output(o) for o in outputs]))

    def failed(self, request_ids: list[str], error: BaseException) -> None:
        self._send(("failed", request_ids, encode_error(error)))

    def stats(self, snapshot: EngineStats) -> None:
        self._send(("stats", snapshot))

    @abc.abstractmethod
    def _send(self, message: tuple[Any, ...]) -> None:
        """Hand one event on (the pipe, the actor's buffer)."""
