"""Publishes the prefix cache's events (engine/kv_events.py) as vLLM does: one msgpack `KVEventBatch` per
engine step on a ZeroMQ PUB socket, as three frames (topic, sequence number as 8 bytes big-endian,
payload), from a thread of its own so a slow network never holds a step; optionally a ROUTER socket that
sends a subscriber the batches it missed (it sends the first sequence number it wants, 8 bytes big-endian;
the answer ends with sequence number -1).

pyzmq and msgspec are imported here only, when `--kv-events-config` asks for the zmq publisher.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventsConfig, as_wire

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
STOP_WAIT_S = 1.0


@functools.cache
def _wire_types() -> dict[str, Any]:
    """msgspec structs with vLLM's names and fields (a tagged union: each event's "type" is its class name)."""
    import msgspec

    class KVCacheEventWire(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStoredWire(KVCacheEventWire, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemovedWire(KVCacheEventWire, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksClearedWire(KVCacheEventWire, tag="AllBlocksCleared"):
        pass

    class KVEventBatchWire(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStoredWire | BlockRemovedWire | AllBlocksClearedWire]
        data_parallel_rank: int | None = None

    return {
        "BlockStored": BlockStoredWire,
        "BlockRemoved": BlockRemovedWire,
        "AllBlocksCleared": AllBlocksClearedWire,
        "batch": KVEventBatchWire,
        "encoder": msgspec.msgpack.Encoder(),
    }


def encode_batch(ts: float, events: list[KVCacheEvent], rank: int) -> bytes:
    """A step's events as vLLM's msgpack KVEventBatch."""
    wire = _wire_types()
    names = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}
    structs = [wire[names[type(event)]](**as_wire(event)) for event in events]
    payload: bytes = wire["encoder"].encode(wire["batch"](ts=ts, events=structs, data_parallel_rank=rank))
    return payload


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """A replica's endpoint: the port plus its rank (tcp), or a suffix (ipc, inproc); rank 0 as given."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.rank = config.data_parallel_rank
        self.topic = config.topic.encode("utf-8")
        self._context: Any = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_port(config.endpoint, self.rank)
        assert endpoint is not None
        # vLLM's rule: a wildcard host (or ipc/inproc) binds, a named host connects.
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        replay = offset_port(config.replay_endpoint, self.rank)
        if replay is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay)
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._sequence = count()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s%s", endpoint, f", replay on {replay}" if replay else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue a step's events (never blocks the step: a full queue drops the batch and counts it)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV cache events: %d batches dropped (the publisher's queue is full)", self.dropped)

    def shutdown(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=STOP_WAIT_S)
        self._thread.join(STOP_WAIT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.rank)
                sequence = next(self._sequence)
                self._pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
                self._sent.append((sequence, payload))
            except Exception:
                logger.exception("KV cache events: a batch could not be published")

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV cache events: a replay request of %d frames, not 3: ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._sent):
            if sequence >= first:
                self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def make_publisher(config: KVEventsConfig) -> ZmqEventPublisher | None:
    """The publisher the config asks for; None when events are off or go nowhere ("null")."""
    if not config.enable_kv_cache_events or config.publisher == "null":
        return None
    return ZmqEventPublisher(config)
