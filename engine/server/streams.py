"""The server side of serving: which HTTP handler each engine request's outputs go to.

HTTP handlers run on an asyncio event loop; the engine's events arrive on
another thread (the engine thread, or the thread that reads the engine
process's pipe). The router keeps, per request, the handler's loop and queue
and its timings; it hands each step's outputs to the loops with one
`call_soon_threadsafe` per loop per step (not one per token), and feeds the
metrics observer (prometheus_client is thread-safe). A lock guards the table:
handlers register and forget requests from the loop while events arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import RequestFailedError
from engine.request import RequestOutput
from engine.stats import EngineStats


@dataclass
class StepObserver:
    """Hooks for metrics, called on the thread that delivers the engine's events."""

    on_first_token: Callable[[float], None] = lambda seconds: None
    on_inter_token: Callable[[float], None] = lambda seconds: None
    on_tokens: Callable[[int], None] = lambda count: None
    on_prompt_tokens: Callable[[int], None] = lambda count: None
    on_finished: Callable[[str, float | None], None] = lambda reason, seconds: None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future | None  # settled once the engine took (or refused) the request
    prompt_len: int
    arrival: float
    last_token: float | None = None


class StreamRouter:
    def __init__(self, observer: StepObserver | None = None) -> None:
        self.observer = observer or StepObserver()
        self.snapshot: EngineStats | None = None  # the engine's latest counters; read by /metrics
        self._streams: dict[str, _Stream] = {}
        self._changes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # register_change
        # A LoRA adapter loaded ("load", name, path) or unloaded ("unload", name, None) through another API-server
        # process over the same engine (engine/server/engine_pipes.py); build_app keeps /v1/models in step.
        self.on_lora_change: Callable[[str, str, str | None], None] = lambda op, name, path: None
        self._lock = threading.Lock()

    # ---- the event loop's side ---------------------------------------------------------------
    def register(self, request_id: str, queue: asyncio.Queue, accepted: asyncio.Future, prompt_len: int) -> None:
        """Before the add command goes out: its acceptance and outputs will be routed here."""
        stream = _Stream(asyncio.get_running_loop(), queue, accepted, prompt_len, time.perf_counter())
        with self._lock:
            self._streams[request_id] = stream

    def forget(self, request_id: str) -> bool:
        """The handler is done with it (abort): later outputs are dropped. True if it was open."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None and stream.accepted is None:
            self.observer.on_finished("abort", None)
        return stream is not None

    def open_request_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    # ---- the engine events' side (EngineEvents) ----------------------------------------------
    def register_change(self, ticket: str, done: asyncio.Future) -> None:
        """An engine change (a LoRA load or unload) whose result comes back as accepted(ticket, error)."""
        with self._lock:
            self._changes[ticket] = (asyncio.get_running_loop(), done)

    def accepted(self, request_id: str, error: BaseException | None) -> None:
        with self._lock:
            change = self._changes.pop(request_id, None)
        if change is not None:
            _call_soon(change[0], _settle, change[1], error)
            return
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return  # the handler left already (and sent the abort)
            future, stream.accepted = stream.accepted, None
            if error is not None:
                del self._streams[request_id]
        if error is None:
            self.observer.on_prompt_tokens(stream.prompt_len)
        if future is not None:
            _call_soon(stream.loop, _settle, future, error)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # aborted while the step ran
                if output.error is not None:
                    # This request made its step fail (the engine re-ran the others without it).
                    self.observer.on_finished("error", now - stream.arrival)
                    deliveries.setdefault(stream.loop, []).append((stream.queue, RequestFailedError(output.error)))
                    del self._streams[output.request_id]
                    continue
                self._observe(stream, output, now)
                deliveries.setdefault(stream.loop, []).append((stream.queue, output))
                if output.finished:
                    del self._streams[output.request_id]
        for loop, items in deliveries.items():
            _call_soon(loop, _deliver, items)

    def failed(self, request_ids: list[str], error: BaseException) -> None:
        with self._lock:
            streams = [s for s in (self._streams.pop(r, None) for r in request_ids) if s is not None]
        for stream in streams:
            if stream.accepted is not None:  # refused before it was taken
                _call_soon(stream.loop, _settle, stream.accepted, error)
            else:
                _call_soon(stream.loop, _deliver, [(stream.queue, error)])

    def stats(self, snapshot: EngineStats) -> None:
        self.snapshot = snapshot  # one reference swap: scrapes on the event loop see a whole snapshot

    def fail_everything(self, error: BaseException) -> None:
        """The engine is gone: every open request ends with error."""
        self.failed(self.open_request_ids(), error)

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        count = len(output.new_token_ids)
        if stream.last_token is None:
            self.observer.on_first_token(now - stream.arrival)
        elif count:
            self.observer.on_inter_token(now - stream.last_token)
        if count:
            stream.last_token = now
            self.observer.on_tokens(count)
        if output.finished:
            self.observer.on_finished(output.finish_reason or "stop", now - stream.arrival)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiting handler was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)
