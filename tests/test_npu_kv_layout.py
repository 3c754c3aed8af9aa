"""NPU backend logic on CPU: npu_scatter_nd_update_ index layouts, the graph budget, padding, replay."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import yaml

from backends.npu.graph_runner import (
    NpuDecodeGraphRunner,
    capture_order,
    fill_static_inputs,
    npu_graph_budget,
    sample_sizes,
)
from backends.npu.kv_store import (
    check_scatter_args,
    page_scatter_indices,
    paged_view,
    scatter_nd_update_reference,
    slot_scatter_indices,
    store_kv_reference,
    updates_for,
)
from backends.npu.platform import NpuPlatform
from engine.platform import CONFIG_DIR, CaptureKind, DeviceUnavailableError
from graphs.static_buffers import StaticDecodeBuffers


def test_index_layouts_and_dtypes() -> None:
    slots = torch.tensor([0, 5, 130, 257], dtype=torch.int64)
    ids = slot_scatter_indices(slots)
    assert ids.shape == (4, 1) and ids.dtype == torch.int32 and ids.is_contiguous()
    assert ids[:, 0].tolist() == [0, 5, 130, 257]
    pairs = page_scatter_indices(slots, page_size=128)
    assert pairs.shape == (4, 2) and pairs.dtype == torch.int32 and pairs.is_contiguous()
    assert pairs.tolist() == [[0, 0], [0, 5], [1, 2], [2, 1]]
    assert torch.equal(pairs[:, 0].long() * 128 + pairs[:, 1], slots)


def test_documented_shape_rule() -> None:
    # The torch_npu reference's example: input (4, 5, 6), indices (3, 2) -> updates (3, 6).
    cache = torch.zeros(4, 5, 6)
    indices = torch.tensor([[0, 1], [3, 4], [2, 0]], dtype=torch.int32)
    updates = torch.arange(18, dtype=torch.float32).reshape(3, 6)
    out = scatter_nd_update_reference(cache, indices, updates)
    assert out is cache  # in place
    assert torch.equal(cache[0, 1], updates[0]) and torch.equal(cache[3, 4], updates[1])
    assert torch.equal(cache[2, 0], updates[2]) and cache.count_nonzero() == 17  # updates[0, 0] is 0
    bad: list[tuple[torch.Tensor, torch.Tensor]] = [
        (indices, torch.zeros(3, 5, 6)),  # wrong updates shape
        (indices[:, 0], torch.zeros(3, 5, 6)),  # 1-d indices
        (indices.float(), updates),  # float indices
        (torch.zeros(3, 4, dtype=torch.int32), updates),  # depth 4 > 3 dims
        (indices, updates.double()),  # dtype mismatch
    ]
    for idx, upd in bad:
        with pytest.raises(ValueError):
            check_scatter_args(cache, idx, upd)
    with pytest.raises(IndexError):
        scatter_nd_update_reference(cache, torch.tensor([[4, 0]], dtype=torch.int64), torch.zeros(1, 6))
    full = scatter_nd_update_reference(torch.zeros(2, 3), torch.tensor([[1, 2]]), torch.tensor([7.0]))
    assert full[1, 2] == 7.0 and full.count_nonzero() == 1  # full-depth index: scalar updates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_layouts_match_index_copy(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    page_size, pages, heads, dim, tokens = 16, 12, 4, 8, 37
    cache = torch.randn(pages * page_size, heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    k = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    expected = cache.clone().index_copy_(0, slots, k)

    by_slot = cache.clone()
    idx = slot_scatter_indices(slots)
    scatter_nd_update_reference(by_slot, idx, updates_for(by_slot, idx, k))
    assert torch.equal(by_slot, expected)

    by_page = cache.clone()
    view = paged_view(by_page, page_size)
    assert view.data_ptr() == by_page.data_ptr()  # a view: writes land in the per-layer cache
    pair = page_scatter_indices(slots, page_size)
    upd = updates_for(view, pair, k)
    assert upd.shape == (tokens, heads, dim)
    scatter_nd_update_reference(view, pair, upd)
    assert torch.equal(by_page, expected)

    # The 4-D view ([slots, 1, heads, dim], updates [tokens, 1, heads, dim]) is the same write in the
    # reference, but CANN's aclnnScatterNdUpdate rejects it at tiling (SGLang memory_pool_npu.py), so
    # store_kv never uses it: only the 3-D slot-id form above and the page form go to the device.
    sg = cache.clone()
    scatter_nd_update_reference(sg.view(-1, 1, heads, dim), idx, k.view(tokens, 1, heads, dim))
    assert torch.equal(sg, expected)

    for ps in (None, page_size):
        kc, vc = cache.clone(), cache.clone()
        store_kv_reference(kc, vc, slots.to(torch.int32), k, k, page_size=ps)
        assert torch.equal(kc, expected) and torch.equal(vc, expected)


@pytest.mark.absent("npu")  # asserts the vendor stack is missing: never on its runner
def test_platform_without_ascend() -> None:
    platform = NpuPlatform()
    assert (platform.name, platform.device_type, platform.dist_backend) == ("npu", "npu", "hccl")
    assert platform.slot_index_dtype == torch.int32
    assert not platform.is_available() and "torch_npu" in platform.unavailable_reason()
    with pytest.raises(DeviceUnavailableError, match="torch_npu"):
        platform.memory_info()
    assert platform.capture_settings().kind is CaptureKind.NPU_GRAPH
    cache = torch.zeros(64, 2, 4)
    k = torch.randn(3, 2, 4)
    slots = torch.tensor([7, 0, 63], dtype=torch.int32)
    platform.store_kv(cache, cache.clone(), slots, k, k)  # CPU tensors take the reference path
    assert torch.equal(cache, torch.zeros(64, 2, 4).index_copy_(0, slots.long(), k))


def test_graph_budget_and_sampling() -> None:
    assert npu_graph_budget(48, num_comm_groups=1, hccl_aiv=True) == 18  # floor(1800 / 49 / 2)
    assert npu_graph_budget(48, num_comm_groups=1) == 11  # floor((1800 - 40) / 49 / 3)
    assert npu_graph_budget(32) == npu_graph_budget(32, hccl_aiv=True) == 54  # floor(1800 / 33)
    assert npu_graph_budget(5000) == 1
    assert sample_sizes(range(1, 11), 4) == [1, 4, 7, 10]
    assert sample_sizes([1, 2, 4], 10) == [1, 2, 4] and sample_sizes([1, 2, 4], 1) == [4]
    big = list(range(8, 513, 8))
    kept = sample_sizes(big, 11)
    assert len(kept) == 11 and kept[0] == 8 and kept[-1] == 512 and set(kept) <= set(big)
    assert capture_order([4, 1, 8, 2]) == [8, 4, 2, 1]


def test_fill_static_inputs_pads_with_dummy_slot_and_zero_len() -> None:
    buffers = StaticDecodeBuffers.allocate(8, 6, 16, "cpu", torch.int32, host_lengths=True)
    assert buffers.slot_indices.dtype == buffers.page_table.dtype == buffers.seq_lens.dtype == torch.int32
    long = torch.arange(1, 8 * 6 + 1, dtype=torch.int32).reshape(8, 6)
    fill_static_inputs(buffers, 8, torch.arange(8), torch.arange(8), torch.arange(8) + 100, long, torch.full((8,), 9))
    table = torch.tensor([[3, 4], [5, 0], [6, 7]], dtype=torch.int32)
    n = fill_static_inputs(
        buffers,
        4,
        torch.tensor([11, 12, 13]),
        torch.tensor([8, 2, 5]),
        torch.tensor([300, 401, 502]),
        table,
        torch.tensor([9, 3, 6], dtype=torch.int32),
    )
    assert n == 3
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.slot_indices[:4].tolist() == [300, 401, 502, 0]  # padded row -> slot 0
    assert buffers.seq_lens[:4].tolist() == [9, 3, 6, 0]  # padded row -> seq_len 0
    assert buffers.page_table[:4].tolist() == [[3, 4, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0], [6, 7, 0, 0, 0, 0], [0] * 6]
    with pytest.raises(ValueError):
        fill_static_inputs(buffers, 2, *(torch.zeros(3, dtype=torch.int64),) * 3, table, torch.ones(3))
    wide = torch.ones(1, 7, dtype=torch.int32)  # uses 7 pages, graphs hold 6
    with pytest.raises(ValueError, match="pages per sequence"):
        fill_static_inputs(buffers, 1, torch.zeros(1), torch.zeros(1), torch.zeros(1), wide, torch.ones(1))


class EagerGraphs:
    """Stand-in for NpuGraphApi: 'replay' re-runs the step on the static buffers, like a graph would.

    `records`: the graph.update records every captured graph reports (these steps launch no real
    attention op, so the records torch_npu would keep are given here).
    """

    def __init__(self, records: list[str] | None = None) -> None:
        self.order: list[int] = []
        self.updates: list[Any] = []
        self.records = ["npu_fused_infer_attention_score.out"] if records is None else records

    def update_records(self, graph: Any) -> list[str]:
        return list(self.records)

    def pool(self) -> None:
        return None

    def stream(self) -> None:
        return None

    def run_on(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        out = fn()
        self.order.append(out.shape[0])
        graphs = self

        class Graph:
            def replay(self) -> None:
                out.copy_(fn())

            def update(self, cpu_update_input: list[dict[str, list[int]]]) -> None:
                graphs.updates.append(cpu_update_input)

        return Graph(), out

    def synchronize(self) -> None:
        pass


def _step(input_ids, positions, slot_indices, page_table, seq_lens):
    row = input_ids * 1000 + positions + seq_lens.long() * 7 + page_table.long().sum(1) * 3 + slot_indices.long()
    return row.float().unsqueeze(1).repeat(1, 5)


def test_runner_replays_padded_and_slices(caplog: pytest.LogCaptureFixture) -> None:
    api = EagerGraphs()
    runner = NpuDecodeGraphRunner(
        _step,
        capture_sizes=[1, 2, 4, 8],
        max_pages_per_seq=4,
        device="cpu",
        seq_lens_update_key="actual_seq_lengths_kv",
        graph_api=api,
    )
    runner.capture()
    assert api.order == [8, 4, 2, 1]  # largest first
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 8)
        seq_lens = torch.tensor([rng.randint(1, 16) for _ in range(n)], dtype=torch.int32)
        table = torch.randint(1, 50, (n, 4), dtype=torch.int32)
        args = (torch.randint(1, 999, (n,)), seq_lens.long() - 1, torch.randint(16, 800, (n,)), table, seq_lens)
        out = runner.run(*args)
        bs = next(s for s in (1, 2, 4, 8) if s >= n)
        assert out.shape == (n, 5) and torch.equal(out, _step(*args))
        assert runner.buffers.seq_lens[n:bs].eq(0).all() and runner.buffers.slot_indices[n:bs].eq(0).all()
        assert api.updates[-1] == [{"actual_seq_lengths_kv": seq_lens.tolist() + [0] * (bs - n)}]
    with pytest.raises(ValueError, match="outside the captured sizes"):
        runner.run(*(torch.zeros(9, dtype=torch.int64),) * 3, torch.zeros(9, 4, dtype=torch.int32), torch.ones(9))
    with caplog.at_level(logging.WARNING):
        capped = NpuDecodeGraphRunner(
            _step,
            capture_sizes=range(1, 101),
            max_pages_per_seq=4,
            device="cpu",
            num_layers=60,
            graph_api=EagerGraphs(),
        )
    assert len(capped.sizes) == npu_graph_budget(60) == 29 and capped.max_size == 100
    assert "aclgraph limit" in caplog.text


def test_npu_config_and_from_config() -> None:
    with open(os.path.join(CONFIG_DIR, "npu.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    assert config["page_size"] == 128 and config["dtype"] == "bfloat16"
    assert max(config["capture_sizes"]) == config["max_capture_size"] <= config["max_num_seqs"]
    runner = NpuDecodeGraphRunner.from_config(_step, config, num_layers=28, device="cpu", graph_api=EagerGraphs())
    assert runner.sizes == sorted(config["capture_sizes"]) and runner.buffers.page_table.shape == (128, 32)


@pytest.mark.absent("npu")  # asserts the vendor stack is missing: never on its runner
def test_import_does_not_load_torch_npu() -> None:
    saved = {name: mod for name, mod in sys.modules.items() if name.startswith("backends.npu")}
    seen: list[str] = []

    class Spy:
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name.split(".")[0] == "torch_npu":
                seen.append(name)
            return None

    spy = Spy()
    sys.meta_path.insert(0, spy)
    try:
        for name in saved:
            del sys.modules[name]
        for name in ("backends.npu", "backends.npu.platform", "backends.npu.kv_store", "backends.npu.graph_runner"):
            importlib.import_module(name)
    finally:
        sys.meta_path.remove(spy)
        sys.modules.update(saved)
    assert seen == [] and "torch_npu" not in sys.modules


def test_engine_adapter_and_int32_slots() -> None:
    from backends.npu.attention import NpuAttentionBackend, NpuDecodeMetadata
    from backends.npu.platform import NpuEngineRunner
    from engine.layers.attention import AttentionMetadata

    assert NpuPlatform().graph_runner_class() is NpuEngineRunner
    assert isinstance(NpuPlatform().attention_backend(), NpuAttentionBackend)

    class Model:
        attention_backend = None  # the runner's own hooks (an engine model has its backend's)

        def __call__(self, input_ids, positions, kv_caches, meta):
            assert isinstance(meta.platform_metadata, NpuDecodeMetadata)  # the host lengths reach attention
            assert meta.platform_metadata.context_lens.device.type == "cpu"
            kv_caches[0][0].index_copy_(0, meta.slot_indices.long(), input_ids.float().view(-1, 1, 1))
            return (input_ids * 100 + meta.seq_lens.long()).float().unsqueeze(1)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden.repeat(1, 3)

    kv = [(torch.zeros(64, 1, 1), torch.zeros(64, 1, 1))] * 4
    api = EagerGraphs(records=["_npu_paged_attention.default"] * len(kv))  # one per layer, as torch_npu records
    runner = NpuEngineRunner(Model(), kv, [1, 2, 4], 4, 16, torch.device("cpu"), graph_api=api)
    runner.capture()
    kv[0][0].zero_()
    slots = torch.tensor([17, 40, 63], dtype=torch.int32)
    meta = AttentionMetadata(
        is_decode=True,
        slot_indices=slots,
        page_table=torch.ones(3, 2, dtype=torch.int32),
        seq_lens=torch.tensor([2, 9, 30], dtype=torch.int32),
        page_size=16,
    )
    out = runner.run_batch(torch.tensor([5, 6, 7]), torch.tensor([1, 8, 29]), meta)
    assert out.tolist() == [[502.0] * 3, [609.0] * 3, [730.0] * 3]
    (update,) = api.updates[-1]  # SGLang's MHA form: context_lens as an int32 host tensor, padded with 0
    assert list(update) == ["context_lens"] and update["context_lens"].tolist() == [2, 9, 30, 0]
    assert kv[0][0].flatten().nonzero().flatten().tolist() == [17, 40, 63]  # padded row wrote only slot 0 (id 0)
