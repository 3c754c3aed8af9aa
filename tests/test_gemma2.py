"""Gemma 2 beyond the HF-parity matrix (test_hf_parity.py holds its tokens and logits to transformers)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import track

from engine.engine import Engine
from engine.errors import UnsupportedArchitectureError
from engine.layers.attention import Attention
from engine.layers.torch_attention import TorchAttentionBackend


def test_each_layer_gets_its_window_and_the_caps(tiny_checkpoints: dict[str, str]) -> None:
    engine = track(
        Engine(
            model=tiny_checkpoints["gemma2"], device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=1024
        )
    )
    layers = [m for m in engine.model.modules() if isinstance(m, Attention)]
    assert [m.sliding_window for m in layers] == [24, None, 24, None]  # layer_types: sliding, full, ...
    assert all(m.softcap == 3.0 and m.scale == 24**-0.5 for m in layers)
    assert engine.max_model_len == 512  # the window does not limit the context


def test_a_backend_without_soft_capping_refuses_the_model(
    tiny_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As HPU and NPU do: soft-capped scores have no exact substitute, so the engine names the gap."""
    no_softcap = dataclasses.replace(TorchAttentionBackend.capabilities, softcap=False)
    monkeypatch.setattr(TorchAttentionBackend, "capabilities", no_softcap)
    with pytest.raises(
        UnsupportedArchitectureError, match="gemma2: attention logit soft-capping is not implemented by the cpu"
    ):
        Engine(
            model=tiny_checkpoints["gemma2"], device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256
        )
