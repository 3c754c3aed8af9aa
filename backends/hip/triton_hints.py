"""AMD launch options for the engine's Triton kernels (backends/cuda/triton_*.py) on ROCm builds of torch.

NOT YET MEASURED ON AMD HARDWARE. On a CUDA (or CPU) build ``triton_launch_options`` returns exactly
the num_warps / num_stages it is given, so passing its result changes nothing there. On ROCm it adds
the AMD backend's compiler options (fields of Triton's ``HIPOptions``,
triton/backends/amd/compiler.py) with the values the public ROCm kernels use:

- decode, stage 1 (grouped GQA decode with tl.dot): ``waves_per_eu=1, matrix_instr_nonkdim=16,
  kpack=2`` and ``num_stages=1`` (vLLM vllm/attention/ops/triton_decode_attention.py
  ``_decode_grouped_att_m_fwd``, the ``is_hip_`` branch, which cites AMD's MI300X Triton
  optimisation guide);
- decode, stage 2 (combine the splits): ``waves_per_eu=4, matrix_instr_nonkdim=16, kpack=2``
  (same file, ``_decode_softmax_reducev_fwd``);
- extend / prefill attention: ``waves_per_eu=1, matrix_instr_nonkdim=16, kpack=2``,
  ``num_stages=1`` and 4 warps with 64 x 64 tiles (SGLang
  python/sglang/srt/layers/attention/triton_ops/extend_attention.py, ``is_hip_`` branches);
- fused MoE: ``num_stages`` at most 2, ``waves_per_eu=0, matrix_instr_nonkdim=16, kpack=2`` for
  tiles of 32 rows or more (vLLM's tuned tables, e.g.
  vllm/model_executor/layers/fused_moe/configs/E=128,N=384,device_name=AMD_Instinct_MI300X.json;
  their small-M entries carry no AMD options).

Architecture rules: the options are for CDNA (gfx90a, gfx94x, gfx95x), whose MFMA units
matrix_instr_nonkdim selects; RDNA (gfx10+) gets only num_warps / num_stages. ``kpack`` follows
PyTorch Inductor's get_default_kpack (torch/_inductor/utils.py: 1 on gfx942 when the dot's K block
is <= 16, else 2) and is left out on gfx950, where Triton deprecates it and forces 1 with a warning.
``matrix_instr_nonkdim=16`` needs dot tiles whose M and N are multiples of 16 (Inductor drops other
configs); a caller that knows its tile passes it. ENGINE_ROCM_TRITON_HINTS=0 turns all of it off.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

KernelKind = Literal["decode", "decode_combine", "extend", "moe"]

# (waves_per_eu, num_stages cap or None) per kernel kind; matrix_instr_nonkdim / kpack as below.
_AMD_OPTIONS: dict[str, tuple[int, int | None]] = {
    "decode": (1, 1),
    "decode_combine": (4, None),
    "extend": (1, 1),
    "moe": (0, 2),
}
EXTEND_ROWS_ON_HIP = 64  # SGLang's HIP extend tile (BLOCK_M = BLOCK_N = 64), vs 128 rows on NVIDIA
EXTEND_WARPS_ON_HIP = 4
MOE_MIN_BLOCK_M_FOR_MFMA_HINTS = 32


def is_rocm_build() -> bool:
    """torch built for ROCm (HIP devices appear as torch "cuda" devices)."""
    return getattr(torch.version, "hip", None) is not None


def gcn_arch(device_index: int = 0) -> str:
    """The AMD GPU's gfx name (e.g. "gfx942" from "gfx942:sramecc+:xnack-"), "" when unknown."""
    try:
        name = str(getattr(torch.cuda.get_device_properties(device_index), "gcnArchName", ""))
    except (AssertionError, RuntimeError):  # no GPU visible
        return ""
    return name.split(":")[0]


def _is_cdna(arch: str) -> bool:
    return arch.startswith(("gfx90a", "gfx94", "gfx95"))


def triton_launch_options(
    kind: KernelKind,
    num_warps: int,
    num_stages: int | None = None,
    *,
    tile_mn: tuple[int, int] | None = None,
    block_k: int | None = None,
    rocm: bool | None = None,
    arch: str | None = None,
) -> dict[str, int]:
    """The launch keywords for one Triton kernel launch: num_warps and num_stages (None: left to Triton),
    plus, on a ROCm build with a CDNA GPU, the AMD compiler options for `kind` (module docstring).

    tile_mn: the (M, N) of the kernel's tl.dot tiles, when known (gates matrix_instr_nonkdim=16).
    block_k: the dot's K block, when known (gates kpack on gfx942). rocm / arch: detected by default.
    """
    options: dict[str, int] = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if kind not in _AMD_OPTIONS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {sorted(_AMD_OPTIONS)}")
    if not (is_rocm_build() if rocm is None else rocm) or os.environ.get("ENGINE_ROCM_TRITON_HINTS", "1") == "0":
        return options
    arch = gcn_arch() if arch is None else arch
    if not _is_cdna(arch):
        return options
    waves_per_eu, stages_cap = _AMD_OPTIONS[kind]
    if stages_cap is not None:
        options["num_stages"] = min(num_stages, stages_cap) if num_stages is not None else stages_cap
    if kind == "extend":
        options["num_warps"] = min(num_warps, EXTEND_WARPS_ON_HIP)
    if kind == "moe" and tile_mn is not None and tile_mn[0] < MOE_MIN_BLOCK_M_FOR_MFMA_HINTS:
        return options  # vLLM's MI300X tables carry no AMD options for the small-M tiles
    options["waves_per_eu"] = waves_per_eu
    if tile_mn is None or (tile_mn[0] % 16 == 0 and tile_mn[1] % 16 == 0):
        options["matrix_instr_nonkdim"] = 16
    if not arch.startswith("gfx95"):
        options["kpack"] = 1 if arch.startswith("gfx942") and block_k is not None and block_k <= 16 else 2
    return options
