"""AsyncEngine: what the HTTP handlers call to run requests on the one engine, wherever it runs.

The Engine is not thread-safe, so one thread makes every engine call, running
engine/server/engine_loop.py's `EngineLoop`. Where that thread lives is the
transport:

- **thread** (`AsyncEngine(engine)`): a thread of the server process. Commands go
  through a thread-safe queue; the loop's events reach the handlers' asyncio queues
  through the router (engine/server/streams.py). The CPU default: on two cores a
  second process only adds copies.
- **process** (`AsyncEngine.over_process(EngineProcess)`, engine/server/engine_process.py):
  an engine process of its own, as vLLM's engine core and SGLang's scheduler run. The
  server process keeps only HTTP, tokenizing and streaming, so its Python work never
  holds the GIL the engine's step loop needs. The default on accelerators, where a
  step is a few milliseconds and the event loop's per-chunk work for hundreds of
  streams would otherwise stall the next launch.

Either way many HTTP requests share one continuously batched engine, and a slow
client never blocks a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from engine.engine import Engine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.engine_loop import Command, EngineDeadError, EngineLoop
from engine.server.engine_thread import EngineThread
from engine.server.streams import StepObserver, StreamRouter
from engine.stats import EngineStats

if TYPE_CHECKING:
    from engine.server.engine_process import EngineHandle

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "RequestGroup", "StepObserver"]


class AsyncEngine:
    def __init__(
        self,
        engine: Engine | None,
        observer: StepObserver | None = None,
        thread: EngineThread | None = None,
        process: EngineHandle | None = None,
    ) -> None:
        """The thread transport for `engine`: `thread` is the thread that built it (engine/server/
        engine_thread.py says why it should run its loop too), by default a new one. With `process`
        (and engine None) the engine lives in that process instead."""
        self.router = StreamRouter(observer)
        self.process = process
        self._loop: EngineLoop | None = None
        if process is None:
            assert engine is not None
            self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
            self._loop = EngineLoop(engine, self.router, self._receive)
            self._thread = thread or EngineThread()
            self.router.snapshot = engine.stats()
        else:
            self.router.snapshot = process.info.stats
        self._stopped = False

    @classmethod
    def over_process(cls, process: EngineHandle, observer: StepObserver | None = None) -> AsyncEngine:
        return cls(None, observer, process=process)

    @property
    def observer(self) -> StepObserver:
        return self.router.observer

    @observer.setter
    def observer(self, observer: StepObserver) -> None:
        self.router.observer = observer

    @property
    def snapshot(self) -> EngineStats:
        assert self.router.snapshot is not None
        return self.router.snapshot

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        if self.process is not None:
            self.process.start_events(self.router)
        else:
            self._thread.run_loop(self._run_loop)
        logger.info("engine loop started (%s)", "own process" if self.process is not None else "server thread")

    @property
    def alive(self) -> bool:
        if self._stopped:
            return False
        if self.process is not None:
            return self.process.alive
        return self._thread.is_alive()

    def _send(self, command: Command) -> None:
        if self.process is not None:
            self.process.send(command)
        else:
            self._commands.put(command)

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, outputs: asyncio.Queue
    ) -> None:
        """Queue a request whose outputs go to `outputs`; raises the engine's InvalidRequestError if rejected."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        accepted = asyncio.get_running_loop().create_future()
        self.router.register(request_id, outputs, accepted, len(prompt_token_ids))
        self._send(("add", request_id, prompt_token_ids, params))
        try:
            await accepted
        except asyncio.CancelledError:
            # The client left before the engine saw the request: it must not run unowned.
            self.abort(request_id)
            raise

    async def change_lora(self, op: str, name: str, path: str | None) -> None:
        """Load ("load", with the adapter folder) or unload a LoRA adapter on the engine's thread, between two
        steps; raises the engine's InvalidRequestError when it refuses."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        ticket = f"lora-{uuid.uuid4().hex}"
        self.router.register_change(ticket, done)
        self._send(("lora", ticket, op, name, path))
        await done

    def abort(self, request_id: str) -> None:
        """Abort on the engine's thread (its KV pages are freed there, before the next step)."""
        self.router.forget(request_id)
        if self.alive:
            self._send(("abort", request_id))

    def fail_all(self, message: str) -> None:
        """End every open request with EngineDeadError(message) (shutdown); the engine keeps running."""
        self._send(("fail_all", message))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is left and stop the engine (after the HTTP server stopped taking requests)."""
        self._stopped = True
        if self.process is not None:
            self.process.stop(timeout)
            self.router.fail_everything(EngineDeadError("the server is shutting down"))
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout)
        else:
            logger.info("engine thread stopped")

    # ---- the thread transport ---------------------------------------------------------------------
    def _run_loop(self) -> None:
        assert self._loop is not None
        self._loop.run()
        # A request registered while the loop was ending never reached it: it must not wait forever.
        self.router.fail_everything(EngineDeadError("the engine is not running"))

    def _receive(self, timeout: float | None) -> list[Command]:
        """Commands for the engine thread: wait up to timeout for the first, then take what is there."""
        try:
            first = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return []
        commands = [first]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands


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
