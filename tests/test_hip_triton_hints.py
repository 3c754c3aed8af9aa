"""The AMD Triton launch-option selection (backends/hip/triton_hints.py) on CPU: never run on an AMD GPU."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from backends.hip.triton_hints import gcn_arch, is_rocm_build, triton_launch_options


def test_cuda_and_cpu_builds_get_exactly_what_they_pass() -> None:
    for kind in ("decode", "decode_combine", "extend", "moe"):
        assert triton_launch_options(kind, 8, 2, rocm=False) == {"num_warps": 8, "num_stages": 2}
        assert triton_launch_options(kind, 4, rocm=False) == {"num_warps": 4}
    if torch.version.hip is None:  # this build: detection says CUDA/CPU, so nothing is added
        assert not is_rocm_build() and triton_launch_options("decode", 4, arch="gfx942") == {"num_warps": 4}


def test_cdna_options_per_kernel_kind() -> None:
    mi300 = dict(rocm=True, arch="gfx942")
    assert triton_launch_options("decode", 4, **mi300) == {
        "num_warps": 4,
        "num_stages": 1,
        "waves_per_eu": 1,
        "matrix_instr_nonkdim": 16,
        "kpack": 2,
    }
    assert triton_launch_options("decode_combine", 2, **mi300) == {
        "num_warps": 2,
        "waves_per_eu": 4,
        "matrix_instr_nonkdim": 16,
        "kpack": 2,
    }
    assert triton_launch_options("extend", 8, 2, **mi300) == {
        "num_warps": 4,
        "num_stages": 1,
        "waves_per_eu": 1,
        "matrix_instr_nonkdim": 16,
        "kpack": 2,
    }
    assert triton_launch_options("moe", 4, 3, tile_mn=(64, 64), block_k=64, **mi300) == {
        "num_warps": 4,
        "num_stages": 2,
        "waves_per_eu": 0,
        "matrix_instr_nonkdim": 16,
        "kpack": 2,
    }
    # Small-M MoE tiles: vLLM's MI300X tables give them no AMD options, only fewer stages.
    assert triton_launch_options("moe", 4, 3, tile_mn=(16, 64), **mi300) == {"num_warps": 4, "num_stages": 2}


def test_architecture_rules() -> None:
    # gfx942 with a K block of 16 or less: kpack 1 (Inductor's get_default_kpack).
    assert triton_launch_options("decode", 4, block_k=16, rocm=True, arch="gfx942")["kpack"] == 1
    assert triton_launch_options("decode", 4, block_k=16, rocm=True, arch="gfx90a")["kpack"] == 2
    # gfx950: Triton deprecates kpack (forces 1 with a warning), so it is not passed.
    assert "kpack" not in triton_launch_options("decode", 4, rocm=True, arch="gfx950")
    # Dot tiles that are not multiples of 16 get no matrix_instr_nonkdim.
    assert "matrix_instr_nonkdim" not in triton_launch_options("decode", 4, tile_mn=(8, 64), rocm=True, arch="gfx942")
    # RDNA / unknown GPUs: no MFMA, so no AMD options at all.
    for arch in ("gfx1100", "gfx1201", ""):
        assert triton_launch_options("extend", 8, 2, rocm=True, arch=arch) == {"num_warps": 8, "num_stages": 2}
    with pytest.raises(ValueError, match="unknown kernel kind"):
        triton_launch_options("gemm", 4, rocm=True, arch="gfx942")  # type: ignore[arg-type]


def test_switch_and_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_ROCM_TRITON_HINTS", "0")
    assert triton_launch_options("decode", 4, rocm=True, arch="gfx942") == {"num_warps": 4}
    monkeypatch.delenv("ENGINE_ROCM_TRITON_HINTS")
    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    )
    assert is_rocm_build() and gcn_arch() == "gfx942"
    assert triton_launch_options("decode", 4)["waves_per_eu"] == 1  # detected: a ROCm build on an MI300


def test_every_option_is_a_triton_amd_compiler_option() -> None:
    """The names must be fields of Triton's HIPOptions, or a launch on ROCm raises on an unknown keyword."""
    compiler = pytest.importorskip("triton.backends.amd.compiler")
    fields = {f.name for f in dataclasses.fields(compiler.HIPOptions)}
    for kind in ("decode", "decode_combine", "extend", "moe"):
        for arch in ("gfx90a", "gfx942", "gfx950"):
            options = triton_launch_options(kind, 4, 2, tile_mn=(64, 64), block_k=64, rocm=True, arch=arch)
            assert set(options) <= fields, (kind, arch, set(options) - fields)
