"""Phi-3 beyond the parity matrix of test_hf_parity.py: its sliding window, LongRoPE and partial rotary."""

from __future__ import annotations

import pytest
from conftest import build_tiny_checkpoint, track
from test_sliding_window import hf_greedy

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.sampling_params import SamplingParams

HALF_DIM = 8  # head_dim 16 (hidden 64 / 4 heads) -> 8 rotary frequencies


def cpu_engine(path: str, **options: object) -> Engine:
    kwargs = dict(device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=2048, max_extend_step_ms=0)
    return track(Engine(model=path, **{**kwargs, **options}))


def test_phi3_sliding_window_matches_transformers_past_the_window(tmp_path) -> None:
    path = build_tiny_checkpoint("phi3", str(tmp_path / "phi3_window"), sliding_window=20)
    engine = cpu_engine(path, chunked_prefill_size=16)
    assert engine.max_model_len == 512
    prompt = [(7 * i) % 340 + 3 for i in range(45)]
    out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(path, prompt, 30)


def test_phi3_longrope_stops_the_context_where_its_short_factors_end(tmp_path) -> None:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(HALF_DIM)],
        "long_factor": [2.0 + 0.5 * i for i in range(HALF_DIM)],
    }
    path = build_tiny_checkpoint(
        "phi3", str(tmp_path / "phi3_longrope"), rope_parameters=rope, original_max_position_embeddings=64
    )
    engine = cpu_engine(path)
    assert engine.max_model_len == 64 and "LongRoPE" in engine.context_limit_reason
    prompt = [(11 * i) % 340 + 3 for i in range(30)]
    out = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 64
    assert out.token_ids == hf_greedy(path, prompt, len(out.token_ids))


def test_partial_rotary_is_refused_naming_it(tmp_path) -> None:
    path = build_tiny_checkpoint(
        "phi3",
        str(tmp_path / "phi3_partial"),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor=0\.5"):
        cpu_engine(path)
