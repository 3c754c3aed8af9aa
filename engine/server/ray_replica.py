"""Replicas as Ray actors (`engine serve --distributed-executor-backend ray`): the same replica set, on any
node of a Ray cluster.

vLLM's default for serving beyond one machine is Ray; here each data-parallel replica is one actor,
placed by a placement group (one bundle per replica: a GPU, or `--torch-threads` CPUs), so a cluster of
several nodes serves one endpoint from the head node. The actor runs the engine loop
(engine/server/engine_loop.py) on a thread of its own, which builds the engine and steps it (one OpenMP team,
as engine/server/engine_thread.py explains); the server sends it commands and long-polls its events, the
same tuples an engine process writes to its pipe (engine/server/engine_process.py), so routing, streaming,
aborts and failures work as with local replicas. An actor that dies (its node gone, an out-of-memory kill)
fails its own requests, and the replica set starts it again in the same bundle.

The cluster: `RAY_ADDRESS` (or `ray start --head` on this node) names one to join; without it, Ray starts a
local one. Ray is imported only here, only for this backend.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from typing import Any

from engine.config import EngineConfig
from engine.server.engine_loop import Command, EngineDeadError, EngineLoop
from engine.server.engine_process import EngineInfo, Placement, engine_info
from engine.server.events_encoding import EncodedEvents, deliver_event
from engine.server.streams import StreamRouter

logger = logging.getLogger(__name__)

EVENT_POLL_S = 0.1  # how long one events() call waits for the engine's next events
STOP_TIMEOUT_S = 30.0


class _BufferedEvents(EncodedEvents):
    """The loop's events, held until the server's next events() call takes them."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._events: list[tuple[Any, ...]] = []

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._ready:
            self._events.append(message)
            self._ready.notify_all()

    def take(self, timeout: float) -> list[tuple[Any, ...]]:
        with self._ready:
            if not self._events:
                self._ready.wait(timeout)
            events, self._events = self._events, []
            return events


class EngineActor:
    """The engine inside a Ray actor (made remote by _actor_class, with one thread for commands and one for
    events, so a long poll never delays a command)."""

    def __init__(self, config: EngineConfig, torch_threads: int | None) -> None:
        self.events = _BufferedEvents()
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._built = threading.Event()
        self._info: EngineInfo | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config, torch_threads), name="engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            raise self._error

    def _run(self, config: EngineConfig, torch_threads: int | None) -> None:
        try:
            if torch_threads is not None:
                import torch

                torch.set_num_threads(torch_threads)
            from engine.engine import Engine

            engine = Engine(config)
            self._info = engine_info(engine)
        except BaseException as exc:
            self._error = exc
            self._built.set()
            return
        self._built.set()
        EngineLoop(engine, self.events, self._receive).run()

    def _receive(self, timeout: float | None) -> list[Command]:
        try:
            first = self.commands.get(timeout=timeout) if timeout else self.commands.get_nowait()
        except queue.Empty:
            return []
        commands = [first]
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def info(self) -> tuple[EngineInfo, str, int]:
        import ray

        assert self._info is not None
        return self._info, ray.get_runtime_context().get_node_id(), os.getpid()

    def submit(self, commands: list[Command]) -> None:
        for command in commands:
            self.commands.put(command)

    def take_events(self, timeout: float) -> list[tuple[Any, ...]]:
        return self.events.take(timeout)

    def stop(self, timeout: float) -> None:
        """Stop the loop (it fails what is open: the server's events thread reads those failures, or, once the
        actor is gone, fails whatever its replica still holds)."""
        self.commands.put(("stop",))
        self._thread.join(timeout)


@functools.cache
def _actor_class() -> Any:
    """EngineActor as a Ray actor: commands (in order, one at a time) and the events' long poll each on a
    thread of their own."""
    import ray

    return ray.remote(concurrency_groups={"commands": 1, "events": 1})(EngineActor)


class RayReplica:
    """One replica's handle on the server (what ReplicaSet drives; EngineProcess's interface)."""

    def __init__(self, config: EngineConfig, placement: Placement, group: Any, bundle: int, gpus: int) -> None:
        self.config = config
        self.placement = placement
        self.group = group
        self.bundle = bundle
        self.gpus = gpus
        self.info: EngineInfo | None = None
        self.error: str | None = None
        self.on_terminate: Any = None  # a Ray actor never sees the server's signals
        self.node = "?"
        self._actor: Any = None
        self._dead = False
        self._stopping = False
        self._reader: threading.Thread | None = None

    def start(self, ready_timeout: float | None = None) -> EngineInfo:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = _actor_class()
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.bundle
        )
        self._actor = remote.options(
            num_cpus=self.placement.torch_threads or 1,
            num_gpus=self.gpus,
            scheduling_strategy=strategy,
            max_restarts=0,  # the replica set restarts a dead replica itself, with its requests failed first
        ).remote(self.config, self.placement.torch_threads)
        start = time.perf_counter()
        try:
            self.info, self.node, pid = ray.get(
                self._actor.info.options(concurrency_group="commands").remote(), timeout=ready_timeout
            )
        except ray.exceptions.RayActorError as exc:
            cause = exc.__cause__ or exc
            raise RuntimeError(f"{self.placement.name} could not start on the Ray cluster: {cause}") from None
        logger.info(
            "%s ready on Ray node %s (pid %d) in %.1f s",
            self.placement.name,
            self.node[:12],
            pid,
            time.perf_counter() - start,
        )
        return self.info

    @property
    def alive(self) -> bool:
        return self._actor is not None and not self._dead

    def send(self, command: Command) -> None:
        if not self.alive:
            raise EngineDeadError(f"{self.placement.name} is not running")
        self._actor.submit.options(concurrency_group="commands").remote([command])

    def start_events(self, router: StreamRouter) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(router,), name=f"{self.placement.name}-events", daemon=True
        )
        self._reader.start()

    def _read(self, router: StreamRouter) -> None:
        import ray

        while not self._dead:
            try:
                events = ray.get(self._actor.take_events.options(concurrency_group="events").remote(EVENT_POLL_S))
            except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as exc:
                if not self._stopping:
                    self.error = f"the engine actor on Ray node {self.node[:12]} died ({type(exc).__name__})"
                    logger.error("%s (%s); its open requests fail", self.error, self.placement.name)
                break
            for event in events:
                deliver_event(event, router)
        self._dead = True
        router.fail_everything(EngineDeadError(self.error or "the server is shutting down"))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        import ray

        self._stopping = True
        if self._actor is None:
            return
        try:
            ray.get(self._actor.stop.options(concurrency_group="commands").remote(timeout), timeout=timeout + 5)
        except Exception as exc:  # already gone, or stuck: it is killed below either way
            logger.info("%s did not stop in order (%s)", self.placement.name, type(exc).__name__)
        ray.kill(self._actor)
        if self._reader is not None:
            self._reader.join(timeout)
        self._dead = True
        logger.info("%s stopped", self.placement.name)


class RayCluster:
    """The placement group the replicas live in, on the cluster `RAY_ADDRESS` names (or a local one)."""

    def __init__(self, replicas: int, gpus_per_replica: int, cpus_per_replica: int, strategy: str = "SPREAD") -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        bundle: dict[str, float] = {"CPU": cpus_per_replica}
        if gpus_per_replica:
            bundle["GPU"] = gpus_per_replica
        self.group = placement_group([dict(bundle) for _ in range(replicas)], strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=300)
        except Exception:
            raise RuntimeError(
                f"the Ray cluster cannot place {replicas} replicas of {bundle} (it has {ray.cluster_resources()})"
            ) from None
        self.gpus = gpus_per_replica
        logger.info("Ray placement group ready: %d bundles of %s (%s)", replicas, bundle, strategy)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        if self.started_ray:
            ray.shutdown()
