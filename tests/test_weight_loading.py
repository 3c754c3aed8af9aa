"""Per-parameter weight loading (engine/loader/param_loading.py), the model registry and interface."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.layers.linear import Linear
from engine.loader.param_loading import attach_weight_loaders, load_checkpoint
from engine.models.interface import CausalLM
from engine.models.registry import model_class_for_type, supported_model_types

ENGINE_OPTIONS = dict(device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256)


def fused_qkv() -> nn.Module:
    model = nn.Module()
    model.qkv_proj = Linear(4, 8, bias=True, parts=[("q", 4), ("k", 2), ("v", 2)])
    return model


def test_a_fused_projection_loads_each_part_from_its_own_tensor() -> None:
    model = fused_qkv()
    q, k, v = torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4)
    biases = torch.randn(4), torch.randn(2), torch.randn(2)
    names = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
    weights = [
        (f"{proj}.{kind}", tensor)
        for proj, w, b in zip(names, (q, k, v), biases)
        for kind, tensor in (("weight", w), ("bias", b))
    ]

    def route(name: str) -> tuple[str, str]:
        proj, kind = name.split(".")
        return f"qkv_proj.{kind}", names[proj]

    load_checkpoint(dict(model.named_parameters()), weights, route)
    torch.testing.assert_close(model.qkv_proj.weight.data, torch.cat([q, k, v]))
    torch.testing.assert_close(model.qkv_proj.bias.data, torch.cat(biases))


def test_a_part_left_out_is_one_error_naming_parameter_and_part() -> None:
    model = fused_qkv()
    weights = [("q", torch.randn(4, 4)), ("v", torch.randn(2, 4)), ("bias", torch.randn(8))]
    routes = {"q": ("qkv_proj.weight", "q"), "v": ("qkv_proj.weight", "v"), "bias": ("qkv_proj.bias", None)}
    with pytest.raises(ModelLoadError, match=r"missing tensors for 1 parameters .*qkv_proj\.weight \(parts k\)"):
        load_checkpoint(dict(model.named_parameters()), weights, routes.__getitem__)


def test_a_wrong_shape_names_the_checkpoint_tensor_and_the_part() -> None:
    model = fused_qkv()
    with pytest.raises(
        ModelLoadError,
        match=r"'k_proj\.weight' -> qkv_proj\.weight: shape mismatch for part 'k'.*\(3, 4\) vs model \(2, 4\)",
    ):
        load_checkpoint(
            dict(model.named_parameters()), [("k_proj.weight", torch.randn(3, 4))], lambda n: ("qkv_proj.weight", "k")
        )


def test_loaders_survive_materialising_off_the_meta_device() -> None:
    with torch.device("meta"):
        model = fused_qkv()
    model = model.to_empty(device="cpu")
    attach_weight_loaders(model)
    load_checkpoint(
        dict(model.named_parameters()),
        [("w", torch.ones(8, 4)), ("b", torch.zeros(8))],
        {"w": ("qkv_proj.weight", None), "b": ("qkv_proj.bias", None)}.__getitem__,
    )
    assert bool((model.qkv_proj.weight == 1).all())


def test_a_checkpoint_tensor_with_no_home_is_refused_naming_it(tiny_checkpoints: dict[str, str], tmp_path) -> None:
    folder = str(tmp_path / "extra")
    shutil.copytree(tiny_checkpoints["qwen3"], folder)  # one unsharded file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.surprise\.weight' has no home"):
        Engine(model=folder, **ENGINE_OPTIONS)


def test_every_registered_family_implements_the_model_interface() -> None:
    types = supported_model_types()
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"} <= set(types)
    methods = [name for name in dir(CausalLM) if not name.startswith("_") and callable(getattr(CausalLM, name))]
    for model_type in types:
        cls = model_class_for_type(model_type)
        missing = [m for m in methods if not callable(getattr(cls, m, None))]
        assert not missing, (model_type, missing)
    assert model_class_for_type("not-a-model", ["MistralForCausalLM"]) is model_class_for_type("mistral")
    assert model_class_for_type("not-a-model", ["NotAnArchitecture"]) is None
