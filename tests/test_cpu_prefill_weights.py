"""The CPU's prefill on a packed bf16 copy of the GGUF weights (backends/cpu/prefill_weights.py, issue #49).

Where it is used, and numerics held to HF transformers: the prefill logits of long prompts (every linear on the
bf16 copy, and attention on bf16 dot products where the CPU has AVX512-BF16, backends/cpu/attention.py; from 256
tokens the MLP's activations in bf16 too) are as close to HF float32's as HF bf16's own are, and greedy text matches
HF float32's."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import engine_logits, greedy, hf_greedy, hf_last_logits

from backends.cpu import prefill_weights
from backends.cpu.attention import PREFILL_BF16_ATTENTION_ROWS, CpuAttentionBackend, _prefill_kernel
from backends.cpu.features import onednn_bf16_supported
from backends.cpu.gguf_linear import PREFILL_MIN_ROWS, PREFILL_WEIGHT_ATTR, gguf_tiles
from engine.engine import Engine
from engine.errors import EngineError

GiB = 2**30
README = os.path.join(os.path.dirname(__file__), "..", "README.md")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_supported(), reason="oneDNN cannot multiply bf16 on this CPU")


def test_the_copy_is_kept_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    choose = prefill_weights.choose_prefill_weights
    assert choose("gguf", GiB // 4, 16 * GiB) == (False, "--cpu-prefill-weights gguf")
    keep, why = choose("auto", GiB // 4, 16 * GiB, activations="float32")
    assert not keep and "exact" in why
    with pytest.raises(EngineError, match="choose one of auto, bf16, gguf"):
        choose("fp8", GiB // 4, 16 * GiB)

    monkeypatch.setattr(prefill_weights, "onednn_bf16_supported", lambda: True)
    features = prefill_weights.cpu_features()
    with_bf16 = type(features)(
        features.arch, frozenset({"avx512_f", "avx512_bw", "avx512_vl", "avx512_bf16"}), features.hidden
    )
    without = type(features)(features.arch, frozenset({"avx2", "fma"}), features.hidden)
    monkeypatch.setattr(prefill_weights, "cpu_features", lambda: with_bf16)
    assert choose("auto", GiB // 4, 16 * GiB)[0]
    keep, why = choose("auto", 5 * GiB, 16 * GiB)  # more than a quarter of what is free
    assert not keep and "would take more than 25%" in why
    monkeypatch.setattr(prefill_weights, "cpu_features", lambda: without)
    keep, why = choose("auto", GiB // 4, 16 * GiB)
    assert not keep and "no native bf16" in why
    assert choose("bf16", GiB // 4, 16 * GiB)[0]  # asked for: emulated bf16 is still allowed where oneDNN runs it
    monkeypatch.setattr(prefill_weights, "onednn_bf16_supported", lambda: False)
    with pytest.raises(EngineError, match="oneDNN cannot multiply bf16"):
        choose("bf16", GiB // 4, 16 * GiB)


@pytest.fixture(scope="module")
def bf16_prefill_engine() -> Any:
    engine = Engine(
        device="cpu", cpu_prefill_weights="bf16", kv_cache_tokens=4096, max_num_seqs=4, max_extend_step_ms=0
    )
    yield engine
    engine.shutdown()
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def long_prompts(smol_hf: tuple[Any, Any]) -> list[list[int]]:
    """Three prompts of 120-460 tokens of English and markdown (this repository's README)."""
    _, tokenizer = smol_hf
    with open(README, encoding="utf-8") as handle:
        text = handle.read()
    ids = tokenizer.encode(text)
    assert len(ids) > 1200
    return [ids[:120], ids[200:520], ids[700:1160]]


@needs_onednn_bf16
def test_every_prefill_linear_has_its_copy_and_the_head_does_not(bf16_prefill_engine: Engine) -> None:
    model = bf16_prefill_engine.model
    layers = prefill_weights.prefill_layers(model)
    assert len(layers) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
    assert all(hasattr(gguf_tiles(layer)[0][2], PREFILL_WEIGHT_ATTR) for layer in layers)
    head = gguf_tiles(model.lm_head)
    assert not head or not hasattr(head[0][2], PREFILL_WEIGHT_ATTR)
    # With the copy, a CPU with AVX512-BF16 runs the prompts' attention on the bf16 kernel (auto): the tests
    # below hold it to HF too.
    backend = model.attention_backend
    assert isinstance(backend, CpuAttentionBackend)
    assert backend.bf16_prefill_rows == (PREFILL_BF16_ATTENTION_ROWS if _prefill_kernel() is not None else 0)


@pytest.fixture(scope="module")
def hf_bf16() -> Any:
    """HF transformers' bf16 model of the same GGUF (its faster dtype on a CPU with native bf16)."""
    from transformers import AutoModelForCausalLM

    from engine.loader.resolve import default_model_path

    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16).eval()
    yield model
    del model
    gc.collect()


@needs_onednn_bf16
def test_prefill_logits_are_as_close_to_hf_float32_as_hf_bf16s(
    bf16_prefill_engine: Engine, smol_hf: tuple[Any, Any], hf_bf16: Any, long_prompts: list[list[int]]
) -> None:
    hf32, _ = smol_hf
    hf16 = hf_bf16
    for ids in long_prompts:
        assert len(ids) >= PREFILL_MIN_ROWS
        reference = hf_last_logits(hf32, ids)
        theirs = (hf_last_logits(hf16, ids).float() - reference).abs().max().item()
        prefill, _ = engine_logits(bf16_prefill_engine, ids, int(reference.argmax()))
        ours = (prefill.float() - reference).abs().max().item()
        assert int(prefill.argmax()) == int(reference.argmax())
        # 0.01 above the block kernels' ~0.003: the rows did go through the bf16 copy.
        assert 0.01 < ours <= max(1.25 * theirs, 0.05), f"{len(ids)} tokens: ours {ours:.3f}, HF bf16 {theirs:.3f}"


@needs_onednn_bf16
def test_greedy_text_of_long_prompts_matches_hf_float32(
    bf16_prefill_engine: Engine, smol_hf: tuple[Any, Any], long_prompts: list[list[int]]
) -> None:
    hf32, _ = smol_hf
    outputs = bf16_prefill_engine.generate(long_prompts, greedy())
    for ids, output in zip(long_prompts, outputs):
        assert output.token_ids == hf_greedy(hf32, ids), f"a {len(ids)}-token prompt"


def test_the_suites_cached_engines_keep_no_copy(engine_cache: Callable[..., Engine]) -> None:
    """engine_cache's engines keep the block kernels for prefill (no copy): the suite's memory."""
    engine = engine_cache(None)
    assert not any(
        hasattr(gguf_tiles(layer)[0][2], PREFILL_WEIGHT_ATTR) for layer in prefill_weights.prefill_layers(engine.model)
    )
