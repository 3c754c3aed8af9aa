"""FP8 KV cache scales from checkpoints (engine/quantization/kv_scales.py): a tiny random Llama saved with
save_pretrained, then k/v scale tensors added to its safetensors file under each name vLLM reads; the
loaded layers' scales, the legacy single kv_scale, float caches ignoring them, and bad scales refused.
The kernels that read the scales: tests/test_triton_kernels.py (test_fp8_kv_scale*)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.layers.attention import Attention
from engine.loader import load_model, resolve_model_source
from engine.quantization.kv_scales import kv_scale_sides

FP8 = torch.float8_e4m3fn
LAYERS = 3


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-kv")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def with_tensors(base: Path, folder: Path, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the base checkpoint with `extra` tensors added to its safetensors file."""
    shutil.copytree(base, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    return str(folder)


def layer_scales(model: torch.nn.Module) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each decoder layer's Attention, checked to be float32 scalars."""
    scales = []
    for layer in model.decoder_layers():
        (attention,) = [m for m in layer.modules() if isinstance(m, Attention)]
        for scale in (attention.k_scale, attention.v_scale):
            assert scale.dtype == torch.float32 and scale.shape == ()
        scales.append((float(attention.k_scale), float(attention.v_scale)))
    return scales


def load(folder: str, kv_cache_dtype: torch.dtype | None) -> torch.nn.Module:
    model, _ = load_model(
        resolve_model_source(folder), torch.float32, torch.device("cpu"), kv_cache_dtype=kv_cache_dtype
    )
    return model


def attn(layer: int, tail: str) -> str:
    return f"model.layers.{layer}.self_attn.{tail}"


def test_scale_names_vllm_reads() -> None:
    assert kv_scale_sides(attn(0, "k_scale")) == ("k",)
    assert kv_scale_sides(attn(0, "v_scale")) == ("v",)
    assert kv_scale_sides(attn(0, "attn.k_scale")) == ("k",)
    assert kv_scale_sides(attn(0, "kv_scale")) == ("k", "v")
    assert kv_scale_sides(attn(0, "k_proj.k_scale")) == ("k",)  # ModelOpt
    assert kv_scale_sides(attn(0, "v_proj.output_scale")) == ("v",)  # compressed-tensors
    assert kv_scale_sides(attn(0, "q_proj.output_scale")) == ()
    assert kv_scale_sides(attn(0, "k_proj.weight_scale")) == ()
    assert kv_scale_sides(attn(0, "k_proj.input_scale")) == ()
    assert kv_scale_sides("model.layers.0.mlp.down_proj.k_scale") == ()  # not attention


def test_fp8_cache_takes_per_layer_scales(base_checkpoint: Path, tmp_path: Path) -> None:
    """k_scale / v_scale per layer (scalars, and shape [1] as some exporters write); a layer without
    them keeps 1.0."""
    folder = with_tensors(
        base_checkpoint,
        tmp_path / "ckpt",
        {
            attn(0, "k_scale"): torch.tensor(2.5),
            attn(0, "v_scale"): torch.tensor([0.75]),
            attn(1, "k_scale"): torch.tensor(4.0, dtype=torch.bfloat16),
            attn(1, "v_scale"): torch.tensor(3.0),
        },
    )
    assert layer_scales(load(folder, FP8)) == [(2.5, 0.75), (4.0, 3.0), (1.0, 1.0)]


def test_legacy_kv_scale_serves_both_sides(base_checkpoint: Path, tmp_path: Path) -> None:
    folder = with_tensors(
        base_checkpoint, tmp_path / "ckpt", {attn(i, "kv_scale"): torch.tensor(1.5 + i) for i in range(LAYERS)}
    )
    assert layer_scales(load(folder, FP8)) == [(1.5, 1.5), (2.5, 2.5), (3.5, 3.5)]


def test_modelopt_and_compressed_tensors_names(base_checkpoint: Path, tmp_path: Path) -> None:
    folder = with_tensors(
        base_checkpoint,
        tmp_path / "ckpt",
        {
            attn(0, "k_proj.k_scale"): torch.tensor(2.0),
            attn(0, "v_proj.v_scale"): torch.tensor(3.0),
            attn(2, "k_proj.output_scale"): torch.tensor(5.0),
            attn(2, "v_proj.output_scale"): torch.tensor(6.0),
        },
    )
    assert layer_scales(load(folder, FP8)) == [(2.0, 3.0), (1.0, 1.0), (5.0, 6.0)]


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.bfloat16, None])
def test_float_cache_ignores_scales(
    base_checkpoint: Path, tmp_path: Path, kv_cache_dtype: torch.dtype | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A float KV cache stores k/v as they are: the checkpoint's scales load without error, are not
    applied (1.0 everywhere), and one log line says so."""
    folder = with_tensors(
        base_checkpoint,
        tmp_path / "ckpt",
        {attn(i, side): torch.tensor(8.0) for i in range(LAYERS) for side in ("k_scale", "v_scale")},
    )
    with caplog.at_level(logging.INFO, logger="engine.quantization.kv_scales"):
        model = load(folder, kv_cache_dtype)
    assert layer_scales(model) == [(1.0, 1.0)] * LAYERS
    assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()] == [
        f"{2 * LAYERS} KV cache scales in the checkpoint ignored: they apply to an FP8 KV cache, "
        f"this one is {kv_cache_dtype}"
    ]


def test_fp8_cache_without_scales_keeps_unit_scale(base_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.quantization.kv_scales"):
        model = load(str(base_checkpoint), FP8)
    assert layer_scales(model) == [(1.0, 1.0)] * LAYERS
    assert any("unit scale" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "bad,error",
    [
        (torch.tensor([1.0, 2.0]), "only per-tensor"),
        (torch.tensor(0.0), "not a positive finite"),
        (torch.tensor(float("nan")), "not a positive finite"),
    ],
)
def test_bad_scales_are_refused(base_checkpoint: Path, tmp_path: Path, bad: torch.Tensor, error: str) -> None:
    folder = with_tensors(
        base_checkpoint, tmp_path / "ckpt", {attn(1, "k_scale"): bad, attn(1, "v_scale"): torch.tensor(1.0)}
    )
    with pytest.raises(ModelLoadError, match=error):
        load(folder, FP8)
