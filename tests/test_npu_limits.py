"""Ascend checks on CPU: _npu_paged_attention's limits, TASK_QUEUE_ENABLE, graph.update records, the workspace."""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import pytest
import torch

from backends.npu.attention import (
    SEQ_LEN_WITH_MAX_PA_WORKSPACE,
    NpuAttentionLimitError,
    NpuDecodeMetadata,
    capture_workspace,
    check_paged_attention_limits,
    paged_attention_args,
)
from backends.npu.graph_runner import (
    NpuDecodeGraphRunner,
    NpuGraphApi,
    NpuGraphUpdateError,
    check_task_queue_for_capture,
    check_update_records,
    task_queue_level,
)
from backends.npu.platform import NpuEngineRunner, model_step
from engine.errors import EngineError


def test_paged_attention_limits_name_the_limit() -> None:
    for ok in [(32, 8, 128, 128), (16, 16, 64, 256), (8, 1, 256, 64), (4, 2, 16, 16)]:
        check_paged_attention_limits(*ok)
    bad = [
        ((12, 8, 128, 128), "heads divisible by KV heads"),
        ((8, 0, 128, 128), "heads divisible by KV heads"),
        ((8, 8, 320, 16), r"head sizes in \(0, 256\]"),
        ((8, 8, 128, 8), r"block_size % 16 == 0.*page_size is 8"),
        ((8, 8, 128, 100), r"block_size % 16 == 0"),
        ((8, 8, 256, 128), r"block_size \* head_size <= 128 \* 128.*--page-size 64 or less"),
        ((8, 8, 192, 128), r"--page-size 80 or less"),  # 16384 // 192 = 85, down to a multiple of 16
    ]
    for args, message in bad:
        with pytest.raises(NpuAttentionLimitError, match=message) as info:
            check_paged_attention_limits(*args)
        assert isinstance(info.value, EngineError)
    check_paged_attention_limits(8, 8, 192, 80)  # the suggested page size fits


def test_task_queue_level_and_capture_check() -> None:
    assert task_queue_level({}) == 1  # torch_npu's default
    assert task_queue_level({"TASK_QUEUE_ENABLE": "2"}) == 2
    assert task_queue_level({"TASK_QUEUE_ENABLE": "0"}) == 0
    assert task_queue_level({"TASK_QUEUE_ENABLE": "2", "ASCEND_LAUNCH_BLOCKING": "1"}) == 0  # blocking: queue off
    assert task_queue_level({"TASK_QUEUE_ENABLE": "1"}, runtime_level=2) == 2  # the runtime's word wins
    for level in (0, 1):
        check_task_queue_for_capture(level)
    with pytest.raises(NpuGraphUpdateError, match="TASK_QUEUE_ENABLE=2"):
        check_task_queue_for_capture(2)


class _Model:
    """An engine model with one attention layer of the given shape (only its Attention module is read)."""

    attention_backend = None  # the runner's own hooks

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        from engine.layers.attention import Attention

        self.layer = Attention(heads, kv_heads, head_dim)

    def modules(self) -> Any:
        return iter([self.layer])


def test_engine_runner_checks_limits_before_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = [(torch.zeros(64, 2, 16), torch.zeros(64, 2, 16))]
    with pytest.raises(NpuAttentionLimitError, match="block_size % 16"):
        NpuEngineRunner(_Model(4, 2, 16), kv, [1, 2], 4, 8, torch.device("cpu"), check_device_limits=True)
    with pytest.raises(NpuAttentionLimitError, match="heads divisible"):
        NpuEngineRunner(_Model(3, 2, 16), kv, [1, 2], 4, 16, torch.device("cpu"), check_device_limits=True)
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "2")
    with pytest.raises(NpuGraphUpdateError, match="TASK_QUEUE_ENABLE=2"):
        NpuEngineRunner(_Model(4, 2, 16), kv, [1, 2], 4, 16, torch.device("cpu"), check_device_limits=True)
    # Off the NPU (the default for CPU tensors) the reference ops take any page size.
    NpuEngineRunner(_Model(4, 2, 16), kv, [1, 2], 4, 8, torch.device("cpu"), graph_api=_NoGraphs())


class _NoGraphs:
    def pool(self) -> None:
        return None


def test_update_record_check() -> None:
    pa = "_npu_paged_attention.default"
    check_update_records([pa] * 4, "context_lens", 4, 8, "2.7.1")
    check_update_records([pa], "context_lens", None, 8, "2.7.1")  # layer count unknown: at least one
    check_update_records(["npu_fused_infer_attention_score.out"] * 2, "actual_seq_lengths_kv", 2, 1, "x")
    refused = [
        (([], "context_lens", 4), r"recorded 0 _npu_paged_attention launches, 4 \(one per attention layer\)"),
        (([pa] * 3, "context_lens", 4), "recorded 3 _npu_paged_attention launches"),
        (([pa] * 8, "context_lens", 4), "recorded 8"),  # twice per layer: not what this step launches
        ((None, "context_lens", 4), "exposes no dispatch records"),
        ((["npu_fused_infer_attention_score.out"], "context_lens", None), "other records"),
    ]
    for (records, key, expected), message in refused:
        with pytest.raises(NpuGraphUpdateError, match=message) as info:
            check_update_records(records, key, expected, 16, "2.5.1.post1")
        text = str(info.value)
        assert "torch_npu 2.5.1.post1" in text and "batch 16" in text and "--disable-graphs" in text


def _fake_torch_npu(monkeypatch: pytest.MonkeyPatch, graph_fn: Any, version: str = "2.5.1.post1") -> None:
    """torch.npu and torch_npu as a release that predates auto_dispatch_capture would offer them."""
    module = types.ModuleType("torch_npu")
    module.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    npu = types.SimpleNamespace(NPUGraph=lambda: types.SimpleNamespace(), graph=graph_fn)
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_graph_api_without_auto_dispatch_fails_at_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    def old_graph(graph: Any, pool: Any = None, stream: Any = None) -> Any:  # no auto_dispatch_capture keyword
        return contextlib.nullcontext()

    _fake_torch_npu(monkeypatch, old_graph)
    ran: list[int] = []
    api = NpuGraphApi(auto_dispatch=True)
    with pytest.raises(NpuGraphUpdateError, match=r"torch_npu 2\.5\.1\.post1: torch\.npu\.graph has no auto_dispatch"):
        api.capture(lambda: ran.append(1) or torch.zeros(1), None, None)
    assert ran == []  # refused before the step ran under capture, not at the first update
    graph, _ = NpuGraphApi(auto_dispatch=False).capture(lambda: torch.zeros(1), None, None)  # nothing to update
    assert NpuGraphApi(auto_dispatch=False).update_records(graph) is None


def test_graph_api_reads_torch_npus_dispatch_records(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_torch_npu(monkeypatch, lambda *args, **kwargs: contextlib.nullcontext())
    op = types.SimpleNamespace(__name__="_npu_paged_attention.default")
    record = types.SimpleNamespace(op_cache_entry=op, handle=object(), event=object(), kwargs={}, args=[])
    graph = types.SimpleNamespace(graph_dispatch_mode=types.SimpleNamespace(graph_dispatch_records=[record] * 3))
    assert NpuGraphApi().update_records(graph) == ["_npu_paged_attention.default"] * 3
    assert NpuGraphApi().update_records(types.SimpleNamespace()) is None


def test_capture_workspace_is_the_largest_up_to_the_longest_context() -> None:
    calls: list[list[int]] = []

    def get_workspace(**kwargs: Any) -> torch.Tensor:
        lens = kwargs["context_lens"]
        assert lens.dtype == torch.int32 and lens.device.type == "cpu"
        calls.append(lens.tolist())
        # Not monotonic in the length, as vllm-ascend's fixed 6144 suggests: peaks there.
        return torch.empty(40_000 - abs(int(lens[0]) - SEQ_LEN_WITH_MAX_PA_WORKSPACE), dtype=torch.uint8)

    cache = torch.zeros(8 * 16, 2, 16, dtype=torch.bfloat16)
    args = paged_attention_args(
        torch.zeros(2, 4, 16, dtype=torch.bfloat16),
        cache,
        cache,
        torch.zeros(2, 8, dtype=torch.int32),
        torch.ones(2, dtype=torch.int32),
        16,
        0.25,
    )
    store: dict[Any, torch.Tensor] = {}
    ws = capture_workspace(get_workspace, args, 32768, store)
    assert calls == [[6144, 6144], [32768, 32768]] and ws.numel() == 40_000  # every row at each candidate length
    assert capture_workspace(get_workspace, args, 32768, store) is ws and len(calls) == 2  # once per shape
    short = capture_workspace(get_workspace, dict(args, query=args["query"][:1]), 4096, store)
    assert calls[-1] == [4096, 4096] and short.numel() == 40_000 - 2048 and len(store) == 2


def test_runner_hands_the_longest_context_to_the_captured_launch_only() -> None:
    seen: list[int] = []
    kv = [(torch.zeros(64, 1, 1), torch.zeros(64, 1, 1))]

    class Model:
        attention_backend = None  # the runner's own hooks (an engine model has its backend's)

        def __call__(self, input_ids, positions, kv_caches, meta):
            extra = meta.platform_metadata
            assert isinstance(extra, NpuDecodeMetadata) and extra.workspaces is not None
            seen.append(extra.workspace_context_len)
            return input_ids.float().unsqueeze(1)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    class Api:
        def pool(self) -> None:
            return None

        def stream(self) -> None:
            return None

        def run_on(self, stream: Any) -> Any:
            return contextlib.nullcontext()

        def synchronize(self) -> None:
            pass

        def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
            return types.SimpleNamespace(), fn()

        def update_records(self, graph: Any) -> list[str]:
            return ["_npu_paged_attention.default"]

    step = model_step(Model(), kv, 16)
    runner = NpuDecodeGraphRunner(
        step,
        capture_sizes=[2],
        max_pages_per_seq=5,
        page_size=16,
        device="cpu",
        warmup_runs=2,
        seq_lens_update_key="context_lens",
        pass_host_seq_lens=True,
        update_records_per_graph=1,
        graph_api=Api(),
    )
    runner.capture()
    assert seen == [0, 0, 80]  # two eager warm-up runs, then the captured launch sized for 5 pages x 16
