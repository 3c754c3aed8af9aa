"""Mixture of experts beyond the HF-parity matrix (test_hf_parity.py runs Mixtral and Qwen3-MoE there)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import build_tiny_checkpoint, track
from safetensors.torch import load_file, save_file

from backends.cpu.platform import CpuPlatform
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.layers.moe import SparseMoE, moe_experts
from engine.platform import CaptureKind, CaptureSettings


def test_experts_op_equals_every_expert_weighted_densely() -> None:
    """Visiting only the chosen experts gives what all experts weighted by a dense routing matrix give."""
    torch.manual_seed(0)
    moe = SparseMoE(hidden_size=32, intermediate_size=24, num_experts=5, top_k=2, renormalize=True)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    hidden = torch.randn(9, 32)
    expert_ids, weights = moe.route(hidden)
    dense = torch.zeros(9, 5).scatter_(1, expert_ids, weights)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    want = torch.zeros_like(hidden)
    for e in range(5):
        gate, up = (hidden @ gate_up[e].T).split(24, dim=-1)
        want += dense[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ down[e].T)
    torch.testing.assert_close(moe_experts(hidden, gate_up, down, expert_ids, weights), want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(9))


def test_qwen3_moe_layers_follow_mlp_only_layers(tiny_checkpoints: dict[str, str]) -> None:
    engine = track(
        Engine(
            model=tiny_checkpoints["qwen3_moe"], device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256
        )
    )
    kinds = [type(layer.mlp).__name__ for layer in engine.model.decoder_layers()]
    assert kinds == ["SparseMoE", "GatedMLP", "SparseMoE"]


def test_a_missing_expert_tensor_is_one_error_naming_it(tmp_path) -> None:
    path = build_tiny_checkpoint("mixtral", str(tmp_path / "mixtral"))
    weights_file = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_file)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"unfilled.*model\.layers\.1\.mlp\.experts\.gate_up_proj \(parts \(3, 'up'\)\)"
    ):
        Engine(model=path, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256)


# Triton's CPU interpreter needs a machine without a GPU driver (tests/conftest.py); on a GPU
# test_cuda.py runs these experts compiled, inside device graphs.
@pytest.mark.absent("cuda", "rocm")
@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_the_fused_triton_experts_give_the_torch_method_s_tokens(tiny_checkpoints: dict[str, str], model: str) -> None:
    """The CUDA experts method (backends/cuda/moe_method.py, here in Triton's CPU interpreter) in a whole
    engine: the same greedy tokens as the torch experts op, and the model then counts as capturable."""
    from helpers import greedy
    from triton_interpreter import interpreter_mode

    from backends.cuda.moe_method import use_fused_moe

    prompts = [[5, 9, 14, 200], list(range(3, 40)), [7] * 11]
    tokens = {}
    for method in ("torch", "triton"):
        engine = track(
            Engine(
                model=tiny_checkpoints[model], device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512
            )
        )
        cuda_graphs = CaptureSettings(kind=CaptureKind.CUDA_GRAPH)
        assert not engine.model.supports_device_graphs(cuda_graphs)
        assert engine.model.supports_device_graphs(CpuPlatform().capture_settings())  # compiled on the host
        if method == "triton":
            assert use_fused_moe(engine.model) > 0 and engine.model.supports_device_graphs(cuda_graphs)
        with interpreter_mode():
            tokens[method] = [o.token_ids for o in engine.generate(prompts, greedy(12))]
        assert engine.kv_pages_in_use() == 0
    assert tokens["triton"] == tokens["torch"]
