"""KV cache events (engine/kv_events.py, engine/kv_event_publisher.py): the prefix cache reports the pages it
stores and drops, and the engine publishes them per step as vLLM does (msgpack KVEventBatch on ZeroMQ), which
a subscriber reads back here, replay included."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_event_publisher import offset_port
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder, KVEventsConfig, page_hash
from engine.radix_cache import RadixCache
from engine.sampling_params import SamplingParams
from engine.server.replicas import _replica_config


def test_stored_pages_chain_their_hashes_and_dropped_pages_name_the_same_hashes() -> None:
    events = KVEventRecorder("CPU")
    tree = RadixCache(page_size=2, free_pages=lambda pages: None, events=events)
    tree.insert([1, 2, 3, 4], [10, 11])
    # Shares the first page, then diverges: the old edge splits, the new leaf chains on the shared page.
    tree.insert([1, 2, 7, 8, 9, 9], [10, 12, 13])
    first, second = events.take()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    shared = page_hash(None, [1, 2])
    assert first.block_hashes == [shared, page_hash(shared, [3, 4])] and first.parent_block_hash is None
    assert first.token_ids == [1, 2, 3, 4] and first.block_size == 2 and first.medium == "CPU"
    assert second.parent_block_hash == shared and second.token_ids == [7, 8, 9, 9]
    assert second.block_hashes == [page_hash(shared, [7, 8]), page_hash(page_hash(shared, [7, 8]), [9, 9])]
    # A cache salt is part of the hash: equal tokens in another namespace are other pages.
    tree.insert([1, 2], [20], namespace="tenant-b")
    (salted,) = events.take()
    assert isinstance(salted, BlockStored) and salted.block_hashes != [shared]

    tree.evict(10)
    removed = events.take()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    dropped = sorted(h for e in removed for h in e.block_hashes)  # type: ignore[union-attr]
    assert dropped == sorted([*first.block_hashes, *second.block_hashes[:], *salted.block_hashes])
    tree.reset()
    assert isinstance(events.take()[-1], AllBlocksCleared)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{nope", "not valid JSON"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown keys"),
        ('{"publisher": "kafka"}', "publisher must be one of"),
        ('{"enable_kv_cache_events": "yes"}', "must be a bool"),
        ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
    ],
)
def test_a_bad_config_is_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(text)


def _receive(sub: Any, timeout_ms: int = 5000) -> list[dict[str, Any]]:
    """Every batch that arrives until the socket is quiet, decoded as plain msgpack (what a Go or Rust
    subscriber sees): [topic, sequence, payload] frames."""
    batches = []
    while sub.poll(timeout_ms):
        topic, sequence, payload = sub.recv_multipart()
        assert topic == b"kv" and len(sequence) == 8
        batches.append(msgspec.msgpack.decode(payload) | {"seq": int.from_bytes(sequence, "big")})
        timeout_ms = 500
    return batches


def test_the_engine_publishes_a_step_s_events_and_replays_missed_ones(tmp_path: Any) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    engine = Engine(
        device="cpu",
        dtype="float32",
        page_size=16,
        kv_cache_tokens=1024,
        disable_graphs=True,
        kv_events_config=json.dumps({**config, "replay_endpoint": replay}),
    )
    try:
        sub.connect(endpoint)
        prompt = list(range(100, 150))  # 50 tokens: 3 full pages
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate([prompt], params)  # a first request: lets the subscription settle
        engine.generate([prompt], params)
        batches = _receive(sub)
        stored = [e for b in batches for e in b["events"] if e["type"] == "BlockStored"]
        assert stored, batches
        pages = [t for e in stored for t in e["token_ids"]]
        assert pages[:48] == prompt[:48] and all(e["block_size"] == 16 and e["medium"] == "CPU" for e in stored)
        assert stored[0]["block_hashes"][0] == page_hash(None, prompt[:16])
        assert all(b["data_parallel_rank"] == 0 and b["ts"] > 0 for b in batches)

        engine.kv_manager.reset_prefix_cache()
        engine.generate([[5] * 20], params)
        kinds = [e["type"] for b in _receive(sub) for e in b["events"]]
        assert "BlockRemoved" in kinds and "AllBlocksCleared" in kinds

        # A subscriber that joined late asks for everything from sequence 0.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while dealer.poll(5000):
            _, sequence, payload = dealer.recv_multipart()
            if int.from_bytes(sequence, "big", signed=True) == -1:
                break
            replayed.append(msgspec.msgpack.decode(payload))
        assert replayed and replayed[0]["events"] and len(replayed) >= len(batches)
        dealer.close(linger=0)
    finally:
        engine.shutdown()
        sub.close(linger=0)


def test_each_replica_publishes_on_its_own_port_with_its_rank() -> None:
    base = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq"}')
    ranks = [KVEventsConfig.parse(_replica_config(base, rank).kv_events_config) for rank in range(3)]
    assert [r.data_parallel_rank for r in ranks] == [0, 1, 2]
    assert [offset_port(r.endpoint, r.data_parallel_rank) for r in ranks] == [
        "tcp://*:5557",
        "tcp://*:5558",
        "tcp://*:5559",
    ]
    assert offset_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert _replica_config(EngineConfig(), 1).kv_events_config is None
