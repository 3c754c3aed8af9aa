"""The graph runners go through the attention backend's capture/replay hooks (graphs/capture_hooks.py).

A CPU backend that records every hook call (and otherwise inherits the default) runs the whole engine
with compiled CPU graphs: the runner must call its hooks, for capture and for every replay, and the
replayed logits must equal those of the stock backend bit for bit. The NPU and HPU runners take their
platform hooks the same way.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest
import torch
from helpers import run_staggered

from backends.cpu.attention import CpuAttentionBackend
from backends.cpu.platform import CpuPlatform
from engine.engine import Engine
from engine.layers.torch_attention import TorchAttentionBackend
from engine.sampling_params import SamplingParams
from graphs.capture_hooks import DEFAULT_HOOKS, CaptureHooks, StaticBufferCaptureHooks, capture_hooks_for

PROMPTS = [[5, 9, 14], list(range(3, 30)), [7] * 11]
ARRIVALS = [0, 0, 2]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class RecordingCpuBackend(CpuAttentionBackend):
    """The CPU backend, its hooks unchanged but every call recorded."""

    calls: ClassVar[list[tuple[str, int]]] = []  # class-level: the tests read and reset it on the class

    def init_capture_state(self, max_bs: int, *args: Any) -> Any:
        self.calls.append(("init_capture_state", max_bs))
        return super().init_capture_state(max_bs, *args)

    def capture_metadata(self, state: Any, bs: int) -> Any:
        self.calls.append(("capture_metadata", bs))
        return super().capture_metadata(state, bs)

    def prepare_for_capture(self, state: Any, bs: int) -> None:
        self.calls.append(("prepare_for_capture", bs))
        super().prepare_for_capture(state, bs)

    def after_capture(self, state: Any, bs: int, graph: Any) -> None:
        self.calls.append(("after_capture", bs))
        super().after_capture(state, bs, graph)

    def prepare_for_replay(self, state: Any, message: Any, batch_state: Any, padded_bs: int) -> torch.Tensor:
        self.calls.append(("prepare_for_replay", padded_bs))
        return super().prepare_for_replay(state, message, batch_state, padded_bs)

    def before_replay(self, state: Any, bs: int, graph: Any) -> None:
        self.calls.append(("before_replay", bs))
        super().before_replay(state, bs, graph)


def test_backends_carry_the_default_hooks() -> None:
    assert isinstance(CpuAttentionBackend(), StaticBufferCaptureHooks)
    backend = CpuAttentionBackend()
    assert capture_hooks_for(backend) is backend and isinstance(backend, CaptureHooks)
    assert capture_hooks_for(TorchAttentionBackend()) is DEFAULT_HOOKS  # a backend without hooks
    assert capture_hooks_for(None) is DEFAULT_HOOKS
    try:
        from backends.cuda.triton_attention import TritonAttentionBackend
    except ImportError:  # no triton here
        return
    assert issubclass(TritonAttentionBackend, StaticBufferCaptureHooks)


def _engine(model: str, backend: type, monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self: backend())
    return Engine(
        model=model,
        device="cpu",
        dtype="float32",
        page_size=8,
        max_num_seqs=4,
        kv_cache_tokens=512,
        max_model_len=128,
        enable_prefix_caching=False,
        max_extend_step_ms=0,
        capture_sizes="1,2,4",
    )


def test_the_runner_calls_the_backends_hooks_and_replays_the_same_logits(
    tiny_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_checkpoints["llama"]
    logits: dict[int, list[torch.Tensor]] = {}
    stock = _engine(model, CpuAttentionBackend, monkeypatch)
    RecordingCpuBackend.calls = []
    recording = _engine(model, RecordingCpuBackend, monkeypatch)
    assert type(recording.runner.graph_runner.hooks) is RecordingCpuBackend
    assert type(stock.runner.graph_runner.hooks) is CpuAttentionBackend
    captured = list(RecordingCpuBackend.calls)
    assert captured[0] == ("init_capture_state", 4)
    for bs in (1, 2, 4):
        assert ("prepare_for_capture", bs) in captured and ("after_capture", bs) in captured
        assert ("capture_metadata", bs) in captured

    runner_cls = type(stock.runner.graph_runner)
    run_decode = runner_cls.run_decode

    def recorded(self: Any, message: Any, state: Any) -> Any:
        out, rows = run_decode(self, message, state)
        logits.setdefault(id(self), []).append(out.clone())
        return out, rows

    monkeypatch.setattr(runner_cls, "run_decode", recorded)
    want = run_staggered(stock, PROMPTS, PARAMS, ARRIVALS).token_ids
    RecordingCpuBackend.calls = []
    got = run_staggered(recording, PROMPTS, PARAMS, ARRIVALS).token_ids
    assert got == want
    replays = [c for c in RecordingCpuBackend.calls if c[0] in ("prepare_for_replay", "before_replay")]
    assert replays and len(replays) == 2 * len(logits[id(recording.runner.graph_runner)])
    assert {bs for name, bs in replays} >= {2, 4}  # padded sizes included (3 rows replay size 4)
    stock_logits, hooked_logits = logits[id(stock.runner.graph_runner)], logits[id(recording.runner.graph_runner)]
    assert len(stock_logits) == len(hooked_logits)
    for a, b in zip(stock_logits, hooked_logits):
        assert torch.equal(a, b)


def test_npu_and_hpu_runners_take_their_platform_hooks() -> None:
    from test_npu_kv_layout import EagerGraphs, _step

    from backends.hpu.attention import HpuAttentionBackend, HpuGraphHooks
    from backends.hpu.graph_runner import HpuDecodeRunner
    from backends.npu.attention import NpuAttentionBackend, NpuGraphHooks
    from backends.npu.graph_runner import NpuDecodeGraphRunner

    assert NpuAttentionBackend.graph_hooks is NpuGraphHooks and HpuAttentionBackend.graph_hooks is HpuGraphHooks
    calls: list[str] = []

    class Recording(NpuGraphHooks):
        def prepare_for_capture(self, state: Any, bs: int) -> None:
            calls.append("prepare_for_capture")
            super().prepare_for_capture(state, bs)

        def after_capture(self, state: Any, bs: int, graph: Any) -> None:
            calls.append("after_capture")
            super().after_capture(state, bs, graph)

        def fill_inputs(self, state: Any, bs: int, *inputs: torch.Tensor) -> int:
            calls.append("fill_inputs")
            return super().fill_inputs(state, bs, *inputs)

        def before_replay(self, state: Any, bs: int, graph: Any) -> None:
            calls.append("before_replay")
            super().before_replay(state, bs, graph)

    api = EagerGraphs()
    runner = NpuDecodeGraphRunner(
        _step,
        capture_sizes=[1, 2, 4],
        max_pages_per_seq=4,
        device="cpu",
        graph_api=api,
        hooks=Recording("actual_seq_lengths_kv", api.update_records),
    )
    runner.capture()
    assert calls == ["prepare_for_capture", "after_capture"] * 3
    rng = random.Random(5)
    seq_lens = torch.tensor([rng.randint(1, 16) for _ in range(3)], dtype=torch.int32)
    args = (
        torch.tensor([3, 4, 5]),
        seq_lens.long() - 1,
        torch.tensor([20, 30, 40]),
        torch.randint(1, 50, (3, 4), dtype=torch.int32),
        seq_lens,
    )
    assert torch.equal(runner.run(*args), _step(*args))
    assert calls[-2:] == ["fill_inputs", "before_replay"]
    assert api.updates[-1] == [{"actual_seq_lengths_kv": [*seq_lens.tolist(), 0]}]

    seen: list[tuple[int, int]] = []

    class HpuRecording(HpuGraphHooks):
        def pad_inputs(self, *inputs: torch.Tensor) -> Any:
            batch = super().pad_inputs(*inputs)
            seen.append(batch.bucket)
            return batch

    def hpu_step(input_ids, positions, slot_indices, page_table, seq_lens):
        return (input_ids * 10 + seq_lens.long()).float().unsqueeze(1)

    hooks = HpuRecording([(2, 4), (4, 8)], page_size=4, max_blocks_per_seq=4)
    hpu = HpuDecodeRunner(
        hpu_step,
        buckets=[(2, 4), (4, 8)],
        page_size=4,
        max_blocks_per_seq=4,
        device="cpu",
        mode="eager",
        show_progress=False,
        hooks=hooks,
    )
    hpu.warmup()
    out = hpu.run(
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 1, 2]),
        torch.tensor([4, 9, 14]),
        torch.tensor([[1, 0], [2, 0], [3, 0]], dtype=torch.int32),
        torch.tensor([1, 2, 3], dtype=torch.int32),
    )
    assert seen == [(4, 8)] and out.squeeze(1).tolist() == [11.0, 22.0, 33.0]
