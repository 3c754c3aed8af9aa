"""KV cache events: which pages the prefix cache stored and dropped, for KV-aware routers.

llm-d's KV-cache indexer and NVIDIA Dynamo route a request to the replica that already holds its prefix by
listening to each engine's cache. vLLM publishes what they read (vllm/distributed/kv_events.py): a batch of
`BlockStored` (hashes of new full pages, the hash of the page before them, their token ids, the page size),
`BlockRemoved` (hashes of dropped pages) and `AllBlocksCleared` events per engine step, msgpack-encoded, on a
ZeroMQ PUB socket. This module is the engine's side: the settings (`--kv-events-config`, vLLM's JSON), the
events, the page hash and the recorder the radix cache (engine/radix_cache.py) fills. The publisher is
engine/kv_event_publisher.py.

A page's hash chains its parent's: sha256 over the parent page's hash, the request's cache salt (a
namespace: pages of different salts never share a hash) and the page's token ids, as 64-bit unsigned
integers. A consumer that wants the same hash for a new prompt computes it with `page_hash`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` keys; data_parallel_rank is set per replica by `--data-parallel-size`."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq": a PUB socket at endpoint; "null": recorded, published nowhere
    endpoint: str = "tcp://*:5557"  # a wildcard host binds; a named host connects (vLLM's rule)
    replay_endpoint: str | None = None  # a ROUTER socket a subscriber asks for missed batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    data_parallel_rank: int = 0  # a replica's endpoint ports are offset by it, and its batches carry it

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        """The config from the flag's JSON (None or empty: events off); unknown keys are refused."""
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config has unknown keys {unknown}; known: {sorted(known)}")
        for key, value in values.items():
            annotation = str(known[key].type)  # "bool", "int", "str" or "str | None" (postponed annotations)
            if value is None and "None" in annotation:
                continue
            expected = {"bool": bool, "int": int, "str": str}[annotation.split(" ")[0]]
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ValueError(f"--kv-events-config {key} must be a {expected.__name__}, got {value!r}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def page_hash(parent: int | None, token_ids: Sequence[int], namespace: str | None = None) -> int:
    """A page's hash: its parent page's hash (None for a first page), its cache salt and its tokens."""
    digest = hashlib.sha256()
    digest.update(struct.pack("<Q", parent) if parent is not None else b"root")
    digest.update((namespace or "").encode("utf-8") + b"\0")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(digest.digest()[:8], "little")


@dataclass
class KVEventRecorder:
    """The events of the steps since the last take(), in order."""

    medium: str  # "GPU" on an accelerator (vLLM's name for device memory), "CPU" on the CPU
    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int], page_size: int) -> None:
        self.events.append(BlockStored(hashes, parent, token_ids, page_size, self.medium))

    def removed(self, hashes: list[int]) -> None:
        self.events.append(BlockRemoved(hashes, self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def as_wire(event: KVCacheEvent) -> dict[str, Any]:
    """The event's fields under vLLM's names (the publisher adds the type tag)."""
    if isinstance(event, BlockStored):
        return {
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"block_hashes": event.block_hashes, "medium": event.medium}
    return {}
