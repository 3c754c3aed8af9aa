"""NPU attention on CPU: the _npu_paged_attention argument layout, the reference path, host lengths per replay."""

from __future__ import annotations

import contextlib
import importlib
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import load_tiny_llama

import backends.npu.attention as npu_attention
from backends.npu.attention import NpuDecodeMetadata, paged_attention_args, paged_attention_reference
from backends.npu.platform import NpuEngineRunner, NpuPlatform
from engine.layers.attention import AttentionMetadata
from engine.layers.torch_attention import TorchAttentionBackend, paged_decode_attention

HEADS, KV_HEADS, DIM = 4, 2, 16
SCALE = DIM**-0.5


def scattered_batch(
    rng: random.Random, seq_lens: list[int], page_size: int, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page_table int32, seq_lens int32, int32 slot of each row's newest token), pages drawn from 1..num_pages-1."""
    need = [-(-n // page_size) for n in seq_lens]
    pages = rng.sample(range(1, num_pages), sum(need))
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for row, count in enumerate(need):
        table[row, :count] = torch.tensor(pages[:count])
        pages = pages[count:]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return table, lens, slots_of(table, lens - 1, page_size).to(torch.int32)


def slots_of(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of token `positions[i]` of row i of the page table (int64)."""
    pages = table.long().gather(1, (positions.long() // page_size).unsqueeze(1)).squeeze(1)
    return pages * page_size + positions.long() % page_size


@pytest.mark.absent("npu")  # asserts the vendor stack is missing: never on its runner
def test_backend_builds_on_cpu_without_torch_npu() -> None:
    saved = {name: mod for name, mod in sys.modules.items() if name.startswith("backends.npu")}
    try:
        for name in saved:
            del sys.modules[name]
        attention = importlib.import_module("backends.npu.attention")
        backend = importlib.import_module("backends.npu.platform").NpuPlatform().attention_backend()
        assert isinstance(backend, attention.NpuAttentionBackend) and backend.seq_lens_update_key == "context_lens"
    finally:
        sys.modules.update(saved)
    assert "torch_npu" not in sys.modules  # nothing above imported the vendor module


def test_paged_attention_args_layout() -> None:
    page_size, pages = 16, 6
    k_cache = torch.randn(pages * page_size, KV_HEADS, DIM, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(3, HEADS, DIM, dtype=torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    table = torch.tensor([[1, 2], [3, 0], [5, 4]], dtype=torch.int32)
    lens = torch.tensor([20, 3, 32], dtype=torch.int32)
    args = paged_attention_args(q, k_cache, v_cache, table, lens, page_size, SCALE)
    key = args["key_cache"]
    # vllm-ascend's [num_blocks, block_size, kv_heads, head_dim]: a view of our [slots, kv_heads, dim] cache.
    assert key.shape == (pages, page_size, KV_HEADS, DIM) and key.is_contiguous()
    assert key.stride() == (page_size * KV_HEADS * DIM, KV_HEADS * DIM, DIM, 1)
    assert key.data_ptr() == k_cache.data_ptr() and args["value_cache"].data_ptr() == v_cache.data_ptr()
    assert torch.equal(key[4, 5], k_cache[4 * page_size + 5])  # slot = page * page_size + offset
    assert args["query"].is_contiguous() and torch.equal(args["query"], q)
    assert args["block_table"] is table and args["context_lens"] is lens
    assert (args["num_heads"], args["num_kv_heads"], args["scale_value"]) == (HEADS, KV_HEADS, SCALE)
    assert args["out"].shape == q.shape and args["out"].dtype == torch.bfloat16
    widened = paged_attention_args(q, k_cache, v_cache, table.long(), lens, page_size, SCALE)
    assert widened["block_table"].dtype == torch.int32

    bad: list[tuple[str, Callable[[], Any]]] = [
        ("multiple of page_size", lambda: paged_attention_args(q, k_cache[:-1], v_cache[:-1], table, lens, 16, SCALE)),
        ("int32 CPU tensor", lambda: paged_attention_args(q, k_cache, v_cache, table, lens.long(), page_size, SCALE)),
        ("int32 CPU tensor", lambda: paged_attention_args(q, k_cache, v_cache, table, lens[:2], page_size, SCALE)),
        ("block_table", lambda: paged_attention_args(q, k_cache, v_cache, table[:2], lens, page_size, SCALE)),
        ("dtype", lambda: paged_attention_args(q.float(), k_cache, v_cache, table, lens, page_size, SCALE)),
        ("heads", lambda: paged_attention_args(q[:, :3], k_cache, v_cache, table, lens, page_size, SCALE)),
    ]
    for message, call in bad:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_decode_matches_torch_reference(page_size: int) -> None:
    rng = random.Random(page_size)
    torch.manual_seed(page_size)
    num_pages = 48 if page_size < 128 else 12
    k_cache = torch.randn(num_pages * page_size, KV_HEADS, DIM)
    v_cache = torch.randn_like(k_cache)
    seq_lens = [1, page_size, 3 * page_size, 2 * page_size + 5, 7]
    table, lens, slots = scattered_batch(rng, seq_lens, page_size, num_pages)
    q, k, v = torch.randn(5, HEADS, DIM), torch.randn(5, KV_HEADS, DIM), torch.randn(5, KV_HEADS, DIM)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = paged_decode_attention(q, k, v, ref_k, ref_v, slots.long(), table, lens, page_size, SCALE)
    for extra in (NpuDecodeMetadata(context_lens=lens.clone()), None):  # graph runner's host lengths / eager
        got_k, got_v = k_cache.clone(), v_cache.clone()
        meta = AttentionMetadata(
            is_decode=True,
            slot_indices=slots,
            page_table=table,
            seq_lens=lens,
            page_size=page_size,
            platform_metadata=extra,
        )
        out = NpuPlatform().attention_backend().forward(q, k, v, got_k, got_v, meta, SCALE)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # the scatter store (int32 slots)


def test_eager_step_copies_lengths_to_host_once() -> None:
    page_size, rng = 16, random.Random(4)
    cache = torch.randn(160, KV_HEADS, DIM)
    table, lens, slots = scattered_batch(rng, [17, 3], page_size, 10)
    q, k = torch.randn(2, HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    ref = paged_decode_attention(q, k, k, cache.clone(), cache.clone(), slots.long(), table, lens, page_size, SCALE)
    backend = NpuPlatform().attention_backend()
    meta = AttentionMetadata(is_decode=True, slot_indices=slots, page_table=table, seq_lens=lens, page_size=page_size)
    with backend.step_context(meta):  # what ModelRunner enters around an eager forward pass
        extra = meta.platform_metadata
        assert isinstance(extra, NpuDecodeMetadata) and extra.context_lens.device.type == "cpu"
        for _ in range(2):  # every layer reuses the one host copy
            out = backend.forward(q, k, k, cache.clone(), cache.clone(), meta, SCALE)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            assert meta.platform_metadata is extra
    assert meta.platform_metadata is None


def test_padded_rows_with_zero_length_give_zeros() -> None:
    cache = torch.randn(64, KV_HEADS, DIM)
    table = torch.tensor([[1], [0], [0]], dtype=torch.int32)
    lens = torch.tensor([5, 0, 0], dtype=torch.int32)
    args = paged_attention_args(torch.randn(3, HEADS, DIM), cache, cache, table, lens, 16, SCALE)
    out = paged_attention_reference(**args)
    assert torch.isfinite(out).all() and out[1:].eq(0).all() and out[0].abs().sum() > 0


# ---- the runner: host lengths reach the captured op only through graph.update --------------------


class FrozenHostArgsGraphs:
    """Stand-in for NpuGraphApi with aclgraph's semantics for host arguments.

    'replay' re-runs the step on the static device buffers, but the host lengths it
    sees are the ones frozen at capture, replaced only by graph.update(cpu_update_input=...)
    and only through what capture recorded: as torch_npu's _GraphDispatchMode, capture keeps one
    record per launch of the attention op (here, each call of the op's CPU reference), and an
    update is applied per record. With record_paged_attention=False it behaves like the
    torch_npu releases that do not record _npu_paged_attention: the update is a silent no-op.
    """

    def __init__(self, record_paged_attention: bool = True) -> None:
        self.updates: list[Any] = []
        self.record_paged_attention = record_paged_attention

    def pool(self) -> None:
        return None

    def stream(self) -> None:
        return None

    def run_on(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def update_records(self, graph: Any) -> list[str]:
        return list(graph.records)

    def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        records: list[str] = []
        original = npu_attention.paged_attention_reference

        def recording(**kwargs: Any) -> torch.Tensor:
            if self.record_paged_attention:
                records.append("_npu_paged_attention.default")
            return original(**kwargs)

        npu_attention.paged_attention_reference = recording
        try:
            out = fn()
        finally:
            npu_attention.paged_attention_reference = original
        host = fn.keywords["seq_lens_host"]  # the view the op was launched with
        frozen = host.clone()
        api = self

        class Graph:
            def __init__(self) -> None:
                self.records = records

            def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
                api.updates.append(cpu_update_input)
                (entry,) = cpu_update_input
                for _ in self.records:  # torch_npu copies a one-entry update once per record
                    frozen.copy_(torch.as_tensor(entry["context_lens"]))

            def replay(self) -> None:
                live = host.clone()
                host.copy_(frozen)  # what the captured kernel would use
                try:
                    out.copy_(fn())
                finally:
                    host.copy_(live)

        return Graph(), out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load_tiny_llama(str(tmp_path_factory.mktemp("tiny_npu_llama")), num_hidden_layers=2)


def set_backend(model: torch.nn.Module, backend: Any) -> None:
    for module in model.modules():
        if module.__class__.__name__ == "Attention":
            module.backend = backend


def test_npu_engine_runner_matches_torch_backend(tiny_llama: tuple[Any, Any]) -> None:
    from engine.kv_cache import KVPool

    model, mc = tiny_llama
    page_size, num_pages, max_pages = 8, 32, 6
    pool = KVPool(
        mc.num_hidden_layers,
        num_pages,
        page_size,
        mc.num_key_value_heads,
        mc.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (6, 16, 21)]
    table, _, _ = scattered_batch(rng, [len(p) + 3 for p in prompts], page_size, num_pages)

    # Prefill through the NPU backend's extend path (scatter store with int32 slots) == the torch backend's.
    tokens = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    slots = torch.cat(
        [slots_of(table[r].expand(len(p), -1), torch.arange(len(p)), page_size) for r, p in enumerate(prompts)]
    )
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))

    def extend(slot_dtype: torch.dtype) -> AttentionMetadata:
        lens = [len(p) for p in prompts]
        return AttentionMetadata(
            is_decode=False,
            slot_indices=slots.to(slot_dtype),
            page_table=table,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            page_size=page_size,
            query_start_loc=starts,
            seq_lens_cpu=lens,
        )

    ref_caches = [(k.clone(), v.clone()) for k, v in pool.caches]
    with torch.no_grad():
        set_backend(model, TorchAttentionBackend())
        ref_hidden = model(tokens, positions, ref_caches, extend(torch.int64))
        set_backend(model, NpuPlatform().attention_backend())
        hidden = model(tokens, positions, pool.caches, extend(torch.int32))
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)

    api = FrozenHostArgsGraphs()
    runner = NpuEngineRunner(model, pool.caches, [1, 2, 4], max_pages, page_size, torch.device("cpu"), graph_api=api)
    runner.capture()
    assert runner.inner.pass_host_seq_lens and runner.inner.seq_lens_update_key == "context_lens"
    next_ids = torch.tensor([p[-1] for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    for rows in ([0, 1, 2], [2, 0], [1, 2, 0]):  # 3 pads to 4 (padded row: length 0, slot 0)
        lens_now = lengths[rows] + 1
        positions = lens_now.long() - 1
        slot_now = slots_of(table[rows], positions, page_size)
        ids = next_ids[rows]

        def meta(
            slot_dtype: torch.dtype,
            slot_now: torch.Tensor = slot_now,
            page_table: torch.Tensor = table[rows],
            lens_now: torch.Tensor = lens_now,
        ) -> AttentionMetadata:
            return AttentionMetadata(
                is_decode=True,
                slot_indices=slot_now.to(slot_dtype),
                page_table=page_table,
                seq_lens=lens_now,
                page_size=page_size,
            )

        with torch.no_grad():
            set_backend(model, TorchAttentionBackend())
            ref = model.compute_logits(model(ids, positions, ref_caches, meta(torch.int64)))
            set_backend(model, NpuPlatform().attention_backend())
            logits = runner.run_batch(ids, positions, meta(torch.int32)).clone()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        (record,) = api.updates[-1]  # SGLang's MHA form: an int32 host tensor, padded rows 0
        bs = 4 if len(rows) > 2 else 2
        assert record["context_lens"].dtype == torch.int32 and record["context_lens"].device.type == "cpu"
        assert record["context_lens"].tolist() == lens_now.tolist() + [0] * (bs - len(rows))
        for (k, v), (rk, rv) in zip(pool.caches, ref_caches):  # page 0 took the padded rows' writes
            torch.testing.assert_close(k[page_size:], rk[page_size:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[page_size:], rv[page_size:], atol=1e-5, rtol=1e-5)
        next_ids[rows] = logits.argmax(-1)
        lengths[rows] += 1


def _decode_once(
    model: Any,
    runner: NpuEngineRunner,
    caches: list,
    table: torch.Tensor,
    lengths: torch.Tensor,
    ids: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(runner logits, torch-backend logits on a copy of the caches) for one decode step of every row."""
    lens_now = lengths + 1
    positions = lens_now.long() - 1
    slots = slots_of(table, positions, page_size)
    meta = AttentionMetadata(
        is_decode=True, slot_indices=slots.to(torch.int32), page_table=table, seq_lens=lens_now, page_size=page_size
    )
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad():
        set_backend(model, TorchAttentionBackend())
        ref_meta = AttentionMetadata(
            is_decode=True, slot_indices=slots, page_table=table, seq_lens=lens_now, page_size=page_size
        )
        ref = model.compute_logits(model(ids, positions, ref_caches, ref_meta))
        set_backend(model, NpuPlatform().attention_backend())
        got = runner.run_batch(ids, positions, meta).clone()
    return got, ref


def test_capture_refuses_a_graph_whose_update_would_be_a_no_op(
    tiny_llama: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from backends.npu import graph_runner
    from backends.npu.graph_runner import NpuGraphUpdateError
    from engine.kv_cache import KVPool

    model, mc = tiny_llama
    page_size, num_pages, max_pages = 8, 32, 6
    pool = KVPool(
        mc.num_hidden_layers,
        num_pages,
        page_size,
        mc.num_key_value_heads,
        mc.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    for k, v in pool.caches:  # some context in every page
        k.normal_()
        v.normal_()
    table, lens, _ = scattered_batch(random.Random(1), [11, 20], page_size, num_pages)
    ids = torch.tensor([17, 99])
    set_backend(model, NpuPlatform().attention_backend())

    # A torch_npu that records nothing under auto-dispatch capture: refused at capture, version named.
    silent = FrozenHostArgsGraphs(record_paged_attention=False)
    runner = NpuEngineRunner(model, pool.caches, [1, 2], max_pages, page_size, torch.device("cpu"), graph_api=silent)
    with pytest.raises(NpuGraphUpdateError, match=r"torch_npu .*recorded 0 _npu_paged_attention launches, 2 \(one per"):
        runner.capture()

    # What that check prevents: the same runner with the check skipped replays capture-time lengths.
    monkeypatch.setattr(graph_runner, "check_update_records", lambda *args: None)
    stale = NpuEngineRunner(
        model,
        pool.caches,
        [1, 2],
        max_pages,
        page_size,
        torch.device("cpu"),
        graph_api=FrozenHostArgsGraphs(record_paged_attention=False),
    )
    stale.capture()
    got, ref = _decode_once(model, stale, pool.caches, table, lens, ids, page_size)
    assert not torch.allclose(got, ref, atol=1e-2)  # silently wrong, not an error
    monkeypatch.undo()

    # One record per attention layer: capture passes and replays follow every update.
    recording = FrozenHostArgsGraphs()
    good = NpuEngineRunner(model, pool.caches, [1, 2], max_pages, page_size, torch.device("cpu"), graph_api=recording)
    good.capture()
    assert all(g.records == ["_npu_paged_attention.default"] * mc.num_hidden_layers for g in good.inner.graphs.values())
    got, ref = _decode_once(model, good, pool.caches, table, lens, ids, page_size)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
