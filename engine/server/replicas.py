"""`engine serve --data-parallel-size N`: N engine processes behind one endpoint, and the router between them.

Each replica is an EngineProcess (engine/server/engine_process.py) with its own share of the host: one GPU
each (CUDA_VISIBLE_DEVICES), or on the CPU its own cores and as many torch threads. A ReplicaSet offers the
server what one EngineProcess does (start, send, start_events, alive, stop), so the HTTP side, streaming
and every guard work unchanged; what it adds is the choice of a replica for each request
(engine/server/prefix_routing.py: SGLang's cache-aware policy by default) and the bookkeeping of which
replica holds which request, so an abort reaches the right one.

A replica that dies is taken out of routing at once; only its own requests fail (each with an error naming
the replica), and it is started again in the background; the others go on serving. /health answers 200
while at least one replica is up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from engine.config import EngineConfig
from engine.kv_events import KVEventsConfig
from engine.platform import Platform
from engine.request import RequestOutput
from engine.server.engine_loop import Command, EngineDeadError
from engine.server.engine_process import EngineInfo, EngineProcess, Placement
from engine.server.metrics import ReplicaCounts
from engine.server.prefix_routing import Router, RoutingPolicy
from engine.server.ray_replica import RayCluster, RayReplica  # imports ray itself only when one is made
from engine.server.streams import StreamRouter
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

BACKENDS = ("mp", "ray")  # vLLM's names for --distributed-executor-backend
RESTART_DELAY_S = 2.0  # before the first restart of a dead replica; doubled per failed try, up to a minute
MAX_RESTART_DELAY_S = 60.0
ROUTER_PAGES_PER_REPLICA = 1 << 16  # pages each replica's routing tree keeps (SGLang: 2**24 characters in all)


def placements(
    platform: Platform, replicas: int, torch_threads: int | None, devices_per_replica: int = 1
) -> list[Placement]:
    """One share of the host per replica on `platform`: devices_per_replica devices each (its tensor-parallel
    ranks'), or on the CPU a block of cores (which its ranks share)."""
    if replicas < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {replicas}")
    if platform.replica_share == "devices":
        assert platform.visible_devices_env is not None, "a platform that shares devices names their variable"
        visible = os.environ.get(platform.visible_devices_env)
        devices = [d for d in visible.split(",") if d.strip()] if visible else None
        if devices is None:
            devices = [str(i) for i in range(platform.device_count() or 0)]
        need = replicas * devices_per_replica
        if len(devices) < need:
            raise ValueError(
                f"--data-parallel-size {replicas} x --tensor-parallel-size {devices_per_replica} needs {need} devices; "
                f"{len(devices)} are visible"
            )
        return [
            Placement(
                torch_threads=torch_threads,
                visible_devices=",".join(devices[i * devices_per_replica : (i + 1) * devices_per_replica]),
                visible_devices_env=platform.visible_devices_env,
                name=f"engine {i}",
            )
            for i in range(replicas)
        ]
    if platform.replica_share != "cores":
        raise ValueError(f"--data-parallel-size > 1 runs on cuda and cpu; not on {platform.name} yet")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < replicas:
        raise ValueError(f"--data-parallel-size {replicas} needs a core per replica; this process may use {len(cores)}")
    share = len(cores) // replicas
    blocks = [tuple(cores[i * share : (i + 1) * share]) for i in range(replicas)]
    return [
        Placement(torch_threads=min(torch_threads or len(block), len(block)), cpu_cores=block, name=f"engine {i}")
        for i, block in enumerate(blocks)
    ]


class _ReplicaEvents:
    """One replica's events, as its EngineProcess reads them, passed to the server's router with the
    ReplicaSet's bookkeeping (which requests it holds) kept on the way."""

    def __init__(self, replicas: ReplicaSet, index: int) -> None:
        self.replicas = replicas
        self.index = index

    @property
    def router(self) -> StreamRouter:
        assert self.replicas.router is not None
        return self.replicas.router

    def accepted(self, request_id: str, error: BaseException | None) -> None:
        if error is not None:
            self.replicas.forget(request_id)
        self.router.accepted(request_id, error)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished or output.error is not None:
                self.replicas.forget(output.request_id)
        self.router.outputs(outputs)

    def failed(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            self.replicas.forget(request_id)
        self.router.failed(request_ids, error)

    def stats(self, snapshot: EngineStats) -> None:
        self.router.stats(self.replicas.record_stats(self.index, snapshot))

    def fail_everything(self, error: BaseException) -> None:
        """The replica's process ended: its requests (only) fail; it leaves the routing."""
        self.replicas.replica_ended(self.index, error)


class ReplicaSet:
    def __init__(
        self,
        config: EngineConfig,
        placements: list[Placement],
        policy: RoutingPolicy,
        backend: str = "mp",
        gpus_per_replica: int = 0,
    ) -> None:
        """backend: "mp", processes of this host; "ray", actors on a Ray cluster (engine/server/ray_replica.py)."""
        if backend not in BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.config = config
        self.placements = placements
        self.backend = backend
        self.gpus_per_replica = gpus_per_replica
        self.cluster: Any = None  # the Ray placement group (backend ray), made in start()
        self.configs = [_replica_config(config, rank) for rank in range(len(placements))]
        self.processes: list[Any] = [None] * len(placements)
        self.router_policy = policy
        self.routing: Router | None = None  # made once the page size is known (start)
        self.router: StreamRouter | None = None
        self.info: EngineInfo | None = None  # type: ignore[assignment]
        self.error: str | None = None
        self.on_terminate: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._up = [False] * len(placements)
        self._owner: dict[str, int] = {}  # request id -> replica
        self._held: list[set[str]] = [set() for _ in placements]
        self._stats: list[EngineStats | None] = [None] * len(placements)
        self._stopping = False
        self.restarts = [0] * len(placements)

    # ---- lifetime -------------------------------------------------------------------------------
    def _new_replica(self, index: int) -> Any:
        """An EngineProcess, or a RayReplica in the index-th bundle of the placement group."""
        if self.backend == "ray":
            return RayReplica(
                self.configs[index], self.placements[index], self.cluster.group, index, self.gpus_per_replica
            )
        return EngineProcess(self.configs[index], placement=self.placements[index])

    def start(self, ready_timeout: float | None = None) -> EngineInfo:
        """Start every replica at once and wait for all; if one fails, stop the others and raise its error."""
        if self.backend == "ray":
            threads = self.placements[0].torch_threads or 1
            self.cluster = RayCluster(len(self.placements), self.gpus_per_replica, threads)
        self.processes = [self._new_replica(i) for i in range(len(self.placements))]
        with ThreadPoolExecutor(len(self.processes)) as pool:
            futures = [pool.submit(p.start, ready_timeout) for p in self.processes]
            errors = [f.exception() for f in futures]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            for process, error in zip(self.processes, errors):
                if error is None:
                    process.stop()
            if self.cluster is not None:
                self.cluster.shutdown()
            raise failed
        infos = [p.info for p in self.processes]
        self._stats = [info.stats for info in infos]
        self.info = replace(infos[0], stats=EngineStats.combine([info.stats for info in infos]))
        self.routing = Router(self.router_policy, infos[0].page_size, ROUTER_PAGES_PER_REPLICA)
        self._up = [True] * len(self.processes)
        for process in self.processes:
            process.on_terminate = self._terminate_requested
        logger.info(
            "%d engine replicas ready (%s), routed by %s",
            len(self.processes),
            "; ".join(_describe(p) for p in self.placements),
            self.router_policy.name,
        )
        return self.info

    def start_events(self, router: StreamRouter) -> None:
        self.router = router
        for index, process in enumerate(self.processes):
            process.start_events(_ReplicaEvents(self, index))  # type: ignore[arg-type]

    @property
    def alive(self) -> bool:
        return any(up and p.alive for up, p in zip(self._up, self.processes))

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        with ThreadPoolExecutor(len(self.processes)) as pool:
            list(pool.map(lambda p: p.stop(timeout), self.processes))
        if self.cluster is not None:
            self.cluster.shutdown()

    def _terminate_requested(self) -> None:
        if self.on_terminate is not None:
            self.on_terminate()

    # ---- requests ---------------------------------------------------------------------------------
    def send(self, command: Command) -> None:
        kind = command[0]
        if kind == "add":
            request_id, prompt_token_ids = command[1], command[2]
            with self._lock:
                load = {i: len(self._held[i]) for i, up in enumerate(self._up) if up}
                if not load or self.routing is None:
                    raise EngineDeadError(self.error or "no engine replica is up")
                index = self.routing.choose(prompt_token_ids, load)
                self._owner[request_id] = index
                self._held[index].add(request_id)
            logger.debug("request %s -> %s (load %s)", request_id, self.placements[index].name, load)
            try:
                self.processes[index].send(command)
            except EngineDeadError:
                self.forget(request_id)
                raise
        elif kind == "abort":
            with self._lock:
                index = self._owner.get(command[1])
            if index is not None:
                with contextlib.suppress(EngineDeadError):
                    self.processes[index].send(command)
                self.forget(command[1])  # the engine sends nothing more for an aborted request
        else:  # fail_all, stop: every replica that is up
            for up, process in zip(self._up, self.processes):
                if up:
                    with contextlib.suppress(EngineDeadError):
                        process.send(command)

    def forget(self, request_id: str) -> None:
        with self._lock:
            index = self._owner.pop(request_id, None)
            if index is not None:
                self._held[index].discard(request_id)

    def load(self) -> list[int]:
        """Requests each replica holds (0 for one that is down)."""
        with self._lock:
            return [len(held) if up else 0 for up, held in zip(self._up, self._held)]

    def counts(self) -> ReplicaCounts:
        """What /metrics shows of the replicas and the router."""
        decisions = dict(self.routing.decisions) if self.routing is not None else {}
        names = [p.name.replace("engine ", "") for p in self.placements]
        return ReplicaCounts(names, list(self._up), self.load(), list(self.restarts), decisions)

    def record_stats(self, index: int, snapshot: EngineStats) -> EngineStats:
        """The replica's latest counters in; the sum over the replicas out."""
        with self._lock:
            self._stats[index] = snapshot
            return EngineStats.combine([s for s in self._stats if s is not None])

    # ---- failures ---------------------------------------------------------------------------------
    def replica_ended(self, index: int, error: BaseException) -> None:
        with self._lock:
            self._up[index] = False
            held = list(self._held[index])
            self._held[index].clear()
            for request_id in held:
                self._owner.pop(request_id, None)
            if self.routing is not None:
                self.routing.replica_down(index)
        name = self.placements[index].name
        if held and self.router is not None:
            self.router.failed(held, EngineDeadError(f"{name}: {error}"))
        if self._stopping:
            return
        self.error = None if any(self._up) else f"every engine replica is down (last: {name}: {error})"
        logger.error(
            "%s is down (%s): %d of its requests failed; the others go on; restarting it", name, error, len(held)
        )
        threading.Thread(target=self._restart, args=(index,), name=f"restart-{name}", daemon=True).start()

    def _restart(self, index: int) -> None:
        delay = RESTART_DELAY_S
        name = self.placements[index].name
        while not self._stopping:
            time.sleep(delay)
            if self._stopping:
                return
            process = self._new_replica(index)
            try:
                process.start()
            except Exception as exc:
                logger.error("%s did not restart (%s); trying again in %.0f s", name, exc, delay)
                delay = min(2 * delay, MAX_RESTART_DELAY_S)
                continue
            if self._stopping:
                process.stop()
                return
            process.on_terminate = self._terminate_requested
            self.processes[index] = process
            process.start_events(_ReplicaEvents(self, index))  # type: ignore[arg-type]
            with self._lock:
                self._up[index] = True
                self.restarts[index] += 1
            self.error = None
            logger.info("%s is back (restart %d)", name, self.restarts[index])
            return


def _replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A replica's config: its KV cache events (if on) carry its rank, on its own port (vLLM's data-parallel
    rule: the endpoint's port plus the rank)."""
    if not config.kv_events_config:
        return config
    events = KVEventsConfig.parse(config.kv_events_config)
    return replace(config, kv_events_config=replace(events, data_parallel_rank=rank).to_json())


def _describe(placement: Placement) -> str:
    where = []
    if placement.visible_devices is not None:
        where.append(f"device {placement.visible_devices}")
    if placement.cpu_cores is not None:
        where.append(f"cores {','.join(map(str, placement.cpu_cores))}")
    if placement.torch_threads is not None:
        where.append(f"{placement.torch_threads} threads")
    return f"{placement.name}: {', '.join(where) or 'the whole host'}"
