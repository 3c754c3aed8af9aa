"""One decode contract for every platform: the engine hands each platform's runner the same step message.

The whole engine runs on this CPU with the HPU runner (bucketed, padded on the host, eager mode, the
HPU attention backend with its flat block layout) and with the NPU runner (its static buffers and
host lengths, through an aclgraph stand-in that freezes host arguments at capture, and the NPU
attention backend with int32 slots) in place of the CPU's compiled graphs. Greedy tokens of
staggered arrivals must equal the plain eager CPU engine's, and every decode step must go through
the runner's `run_decode`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import hpu_device_config, run_staggered
from test_npu_attention import FrozenHostArgsGraphs

from backends.cpu.platform import CpuPlatform
from backends.hpu.platform import HpuEngineRunner, HpuPlatform
from backends.npu.platform import NpuEngineRunner, NpuPlatform
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PROMPTS = [[5, 9, 14], list(range(3, 40)), [7] * 19, [11, 12, 13, 14, 15, 16]]
ARRIVALS = [0, 0, 3, 7]
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _hpu_runner(*args: Any, strict: bool | None = None, **kwargs: Any) -> HpuEngineRunner:
    # Small block buckets, so a 256-token context needs few warm-up shapes.
    config = hpu_device_config(decode_block_bucket=(4, 4, 32))
    return HpuEngineRunner(*args, mode="eager", show_progress=False, device_config=config, **kwargs)


def _npu_runner(*args: Any, strict: bool | None = None, **kwargs: Any) -> NpuEngineRunner:
    return NpuEngineRunner(*args, graph_api=FrozenHostArgsGraphs(), **kwargs)


PLATFORMS: dict[str, tuple[Callable[..., Any], Any, torch.dtype]] = {
    "hpu": (_hpu_runner, HpuPlatform, torch.int64),
    "npu": (_npu_runner, NpuPlatform, torch.int32),
}


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_vendor_runners_take_the_engines_step_messages(
    platform: str, tiny_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner_factory, vendor, slot_dtype = PLATFORMS[platform]
    model = tiny_checkpoints["llama"]
    options = dict(
        model=model,
        device="cpu",
        dtype="float32",
        page_size=8,
        max_num_seqs=4,
        kv_cache_tokens=1024,
        max_model_len=256,
        enable_prefix_caching=False,
        debug_kv_invariant=True,
        max_extend_step_ms=0,
    )
    want = run_staggered(Engine(disable_graphs=True, **options), PROMPTS, PARAMS, ARRIVALS).token_ids

    monkeypatch.setattr(CpuPlatform, "graph_runner_class", lambda self: runner_factory)
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self: vendor().attention_backend())
    monkeypatch.setattr(CpuPlatform, "slot_index_dtype", slot_dtype)
    engine = Engine(capture_sizes="1,2,4", **options)
    calls: list[int] = []
    run_decode = type(engine.runner.graph_runner).run_decode

    def counted(self: Any, message: Any, state: Any) -> Any:
        calls.append(message.batch_size)
        return run_decode(self, message, state)

    monkeypatch.setattr(type(engine.runner.graph_runner), "run_decode", counted)
    # The runner's hooks are the attention backend's (its graph_hooks), and every decode step's replay
    # inputs come through their prepare_for_replay (graphs/capture_hooks.py's contract).
    hooks = engine.runner.graph_runner.inner.hooks
    assert type(hooks) is type(engine.model.attention_backend).graph_hooks
    replays: list[int] = []
    prepare = type(hooks).prepare_for_replay

    def recorded(self: Any, replay_state: Any, message: Any, batch_state: Any, padded_bs: int) -> torch.Tensor:
        replays.append(message.batch_size)
        return prepare(self, replay_state, message, batch_state, padded_bs)

    monkeypatch.setattr(type(hooks), "prepare_for_replay", recorded)
    got = run_staggered(engine, PROMPTS, PARAMS, ARRIVALS)
    assert got.token_ids == want
    assert calls and set(calls) >= {1, 2, 3, 4}  # padded sizes (3) included
    assert replays == calls
    assert engine.runner.eager_steps == len(got.recorder.extend_sizes)  # every decode step went through it
