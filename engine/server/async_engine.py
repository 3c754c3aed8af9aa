"""The engine thread and its asyncio bridge.

The Engine is not thread-safe, so one dedicated thread makes every engine call
(add_request, step, abort). HTTP handlers on the event loop send it commands
through a thread-safe queue; results come back through asyncio futures and
per-request asyncio queues, fed with loop.call_soon_threadsafe. Many HTTP
requests therefore share one continuously batched engine, and a slow client
never blocks a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.engine import Engine
from engine.errors import EngineError, RequestFailedError
from engine.request import RequestOutput
from engine.server.engine_thread import EngineThread
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long an idle engine thread blocks on the command queue


class EngineDeadError(RuntimeError):
    """The engine thread is gone (shut down, or a bug killed it)."""


@dataclass
class _Stream:
    """Engine-thread bookkeeping of one request: where its outputs go, and its timings."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0


@dataclass
class StepObserver:
    """Hooks for metrics, called on the engine thread (prometheus_client is thread-safe)."""

    on_first_token: Callable[[float], None] = lambda seconds: None
    on_inter_token: Callable[[float], None] = lambda seconds: None
    on_tokens: Callable[[int], None] = lambda count: None
    on_prompt_tokens: Callable[[int], None] = lambda count: None
    on_finished: Callable[[str, float | None], None] = lambda reason, seconds: None


class AsyncEngine:
    def __init__(self, engine: Engine, observer: StepObserver | None = None, thread: EngineThread | None = None) -> None:
        """`thread`: the thread that built the engine, to run its loop too (engine/server/engine_thread.py);
        by default a new one."""
        self.engine = engine
        self.observer = observer or StepObserver()
        self.snapshot: EngineStats = engine.stats()  # rewritten after every step; read by /metrics
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stop = threading.Event()
        self._thread = thread or EngineThread()

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.run_loop(self._run)
        logger.info("engine thread started")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, outputs: asyncio.Queue
    ) -> None:
        """Queue a request whose outputs go to `outputs`; raises the engine's InvalidRequestError if rejected."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        self._commands.put(("add", request_id, prompt_token_ids, params, loop, outputs, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            # The client left before the engine thread saw the request: it must not run unowned.
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort on the engine thread (its KV pages are freed there, before the next step)."""
        self._commands.put(("abort", request_id))

    def fail_all(self, message: str) -> None:
        """End every open request with EngineDeadError(message) (shutdown); the thread keeps running."""
        self._commands.put(("fail_all", message))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is left and stop the thread (after the HTTP server stopped taking requests)."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout)
        else:
            logger.info("engine thread stopped")

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._update_stats()
        except BaseException as exc:  # a bug: report it everywhere rather than hang clients
            logger.exception("engine thread died")
            self.error = exc
        finally:
            self._abort_all(EngineDeadError("the server is shutting down" if self.error is None else f"engine failed: {self.error}"))
            try:
                self._update_stats()
            except Exception:  # noqa: BLE001 - a dead engine may not report; the thread must still end
                logger.exception("final stats update failed")

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_token_ids, params, loop, outputs, accepted = command
            try:
                self.engine.add_request(prompt_token_ids, params, request_id=request_id)
            except Exception as exc:  # noqa: BLE001 - every rejection goes back to its handler
                if not isinstance(exc, EngineError):
                    logger.exception("add_request failed for %s", request_id)
                loop.call_soon_threadsafe(_settle, accepted, exc)
                return
            self._streams[request_id] = _Stream(loop, outputs, time.perf_counter())
            self.observer.on_prompt_tokens(len(prompt_token_ids))
            loop.call_soon_threadsafe(_settle, accepted, None)
        elif kind == "fail_all":
            self._abort_all(EngineDeadError(command[1]), reject_queued_adds=False)
        elif kind == "abort":
            request_id = command[1]
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self.observer.on_finished("abort", None)
                logger.debug("aborted %s", request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001
            self._fail_step(exc)
            return
        now = time.perf_counter()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
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
        # One wake-up of the event loop per step, not one per token.
        for loop, items in deliveries.items():
            _call_soon(loop, _deliver, items)

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        count = len(output.new_token_ids)
        if stream.last_token is None:
            self.observer.on_first_token(now - stream.arrival)
        elif count:
            self.observer.on_inter_token(now - stream.last_token)
        if count:
            stream.last_token = now
            stream.num_tokens += count
            self.observer.on_tokens(count)
        if output.finished:
            self.observer.on_finished(output.finish_reason or "stop", now - stream.arrival)

    def _fail_step(self, exc: Exception) -> None:
        """The requests the failed step dropped get the error; everything else keeps going."""
        logger.exception("engine step failed")
        scheduler = self.engine.scheduler
        live_requests = list(scheduler.running) + list(scheduler.waiting)
        chunked = scheduler.chunked  # a request part-way through a chunked prefill
        if chunked is not None:
            live_requests.append(chunked)
        live = {r.request_id for r in live_requests}
        dropped = [request_id for request_id in self._streams if request_id not in live]
        if not dropped:
            # Nothing identifiable was dropped: abort everything rather than fail the same way forever.
            dropped = list(self._streams)
        error = RequestFailedError(f"generation failed: {type(exc).__name__}: {exc}")
        for request_id in dropped:
            stream = self._streams.pop(request_id)
            self.engine.abort(request_id)
            _call_soon(stream.loop, _deliver, [(stream.queue, error)])

    def _abort_all(self, error: BaseException, reject_queued_adds: bool = True) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", request_id)
            _call_soon(stream.loop, _deliver, [(stream.queue, error)])
        self._streams.clear()
        # Commands that arrived too late: reject adds so their handlers do not wait forever.
        while reject_queued_adds:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _call_soon(command[4], _settle, command[6], error)

    def _update_stats(self) -> None:
        self.snapshot = self.engine.stats()  # one reference swap: scrapes on the event loop see a whole snapshot


class RequestGroup:
    """The engine requests behind one HTTP request (prompts x n choices), sharing one output queue.

    One queue keeps the choices' outputs in step order, so a stream interleaves them naturally.
    """

    def __init__(self, engine: AsyncEngine, on_done: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished: set[str] = set()
        self._on_done = on_done  # called once, on the first abort(): every way out calls it

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        await self.engine.add_request(request_id, prompt_token_ids, params, self.queue)
        self.unfinished.add(request_id)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.output_batches():
            for output in batch:
                yield output

    async def output_batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Outputs in step order, as many at a time as have arrived: a stream that fell behind (many
        streams, one event loop) catches up with one write per batch instead of one per token."""
        while self.unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch: list[RequestOutput] = []
            for item in items:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch  # what came before the failure still goes out
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
                batch.append(item)
            yield batch

    def abort(self) -> None:
        """Abort whatever has not finished (a no-op once all have): call it on every way out."""
        for request_id in self.unfinished:
            self.engine.abort(request_id)
        self.unfinished.clear()
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()


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
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass
