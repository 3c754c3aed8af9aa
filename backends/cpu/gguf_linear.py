"""GGUF weights kept in their blocks on the CPU (Q4_1, Q8_0): a linear method and an embedding.

The dense path dequantizes every GGUF tensor at load: SmolLM2's 98 MB Q4_1 file became 513 MiB of
float32 that each decode step streams. Here the linear layers keep the file's blocks and multiply
through kernels/gguf_matmul.c, which unpacks each block in registers (AVX2 where the CPU has it,
portable C otherwise); a step with more rows than the fused kernel takes (prefill) dequantizes the
matrix in C and runs the float GEMM. The token embedding gathers its rows' blocks and dequantizes
them; a tied LM head multiplies by the same blocks.

Which tensors stay quantized: those whose every part (q, k, v of a fused projection) has one of
the kernel's block types. Others (F32 norms; Q6_K, Q4_K until their kernels exist) load dense.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backends.cpu.features import cpu_features
from backends.cpu.native import load
from engine.layers.linear import DENSE, Linear
from engine.layers.ops import define_op

logger = logging.getLogger(__name__)

FUSED_MAX_ROWS = 16  # the C kernel's MAX_ROWS
FUSED_MAX_COLUMNS = 1024 * 32  # and its MAX_BLOCKS blocks of 32 (Llama-3-405B's down_proj takes the other path)


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the kernel's q8 flag
    block_bytes: int  # per 32 weights


FORMATS = {"Q4_1": BlockFormat("Q4_1", 0, 20), "Q8_0": BlockFormat("Q8_0", 1, 34)}
_BY_CODE = {f.code: f for f in FORMATS.values()}


@lru_cache(maxsize=None)
def _library() -> Any:
    lib = load("gguf_matmul")
    if lib is None:
        return None
    for name in ("gguf_q4_1_matmul", "gguf_q8_0_matmul"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    lib.gguf_matmul_int8.restype = ctypes.c_int
    lib.gguf_matmul_int8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 6
    lib.gguf_dequantize.restype = ctypes.c_int
    lib.gguf_dequantize.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    lib.gguf_has_avx2.restype = ctypes.c_int
    return lib


def gguf_kernels_available() -> bool:
    return _library() is not None


@lru_cache(maxsize=None)
def simd_path() -> bool:
    """The kernel's AVX2 path: built in (gcc targets this CPU) and not hidden (ENGINE_CPU_HIDE_FEATURES).
    Decided once: every linear of every decode step asks."""
    lib = _library()
    return lib is not None and bool(lib.gguf_has_avx2()) and cpu_features().has("avx2", "fma3")


def dequantize_blocks(blocks: torch.Tensor, code: int, out_features: int, in_features: int) -> torch.Tensor:
    """The float32 [out, in] matrix of a block tensor [out, in / 32 * block_bytes]."""
    out = torch.empty(out_features, in_features, dtype=torch.float32)
    status = _library().gguf_dequantize(blocks.data_ptr(), out.data_ptr(), out_features, in_features, code,
                                        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"GGUF dequantize refused shape [{out_features}, {in_features}]")
    return out


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, code: int, out_features: int,
                int8_activations: bool = False) -> torch.Tensor:
    """x [..., in] @ W.T with W in GGUF blocks; in x's dtype, accumulated in float32.
    int8_activations: decode rows quantized to int8 blocks first, integer dot products (llama.cpp's
    numerics: faster, less exact)."""
    lib = _library()
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.shape[0] > FUSED_MAX_ROWS or in_features > FUSED_MAX_COLUMNS:
        # Prefill (or a matrix wider than the fused kernel's per-block sums): one dequantized matrix
        # serves every row, and the float GEMM is the fast part.
        weight = dequantize_blocks(blocks, code, out_features, in_features).to(x.dtype)
        return F.linear(x, weight)
    rows32 = rows.to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if int8_activations:
        status = lib.gguf_matmul_int8(blocks.data_ptr(), rows32.data_ptr(), out.data_ptr(), rows.shape[0],
                                      out_features, in_features, code, torch.get_num_threads(), int(simd_path()))
    else:
        kernel = lib.gguf_q8_0_matmul if code == FORMATS["Q8_0"].code else lib.gguf_q4_1_matmul
        status = kernel(blocks.data_ptr(), rows32.data_ptr(), out.data_ptr(), rows.shape[0], out_features,
                        in_features, torch.get_num_threads(), int(simd_path()))
    if status != 0:
        raise ValueError(f"GGUF matmul refused x {tuple(x.shape)} by [{out_features}, {in_features}]")
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _gguf_linear_fake(x, blocks, code, out_features, int8_activations=False):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], out_features))


define_op("gguf_linear", "(Tensor x, Tensor blocks, int code, int out_features, bool int8_activations=False) -> Tensor",
          gguf_linear, _gguf_linear_fake)

ACTIVATIONS = ("float32", "int8")  # --gguf-activations


class GGUFLinearMethod:
    """engine.layers.linear.LinearMethod over the layer's `gguf_blocks` buffer."""

    def __init__(self, fmt: BlockFormat, int8_activations: bool = False) -> None:
        self.fmt = fmt
        self.int8_activations = int8_activations
        self.name = f"gguf_{fmt.name.lower()}" + ("_int8_activations" if int8_activations else "")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.engine.gguf_linear(x, layer.gguf_blocks, self.fmt.code, layer.out_features,
                                           self.int8_activations)
        return out if layer.bias is None else out + layer.bias


_METHODS = {(name, int8): GGUFLinearMethod(fmt, int8) for name, fmt in FORMATS.items() for int8 in (False, True)}


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over GGUF blocks [vocab, dim / 32 * block_bytes]: gathered rows dequantized."""

    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("gguf_blocks", blocks, persistent=False)
        self.fmt, self.dim, self.dtype = fmt, dim, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.gguf_blocks[input_ids.reshape(-1)]
        blocks = rows.view(rows.shape[0], self.dim // 32, self.fmt.block_bytes)
        scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.fmt.name == "Q8_0":
            values = blocks[..., 2:].contiguous().view(torch.int8).float() * scale
        else:
            packed = blocks[..., 4:]
            quants = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
            values = quants * scale + blocks[..., 2:4].contiguous().view(torch.float16).float()
        return values.reshape(*input_ids.shape, self.dim).to(self.dtype)


def keep_gguf_blocks(model: nn.Module, path: str, activations: str = "float32") -> int:
    """Switch every Linear (and the token embedding) whose GGUF tensors all have a kernel format to
    those blocks, freeing the dense weights; returns the bytes of blocks kept. activations: how the
    decode kernels take their inputs (ACTIVATIONS)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"GGUF activations must be one of {ACTIVATIONS}, got {activations!r}")
    import gguf

    from engine.loader.weights import gguf_arch, gguf_name_to_hf, unpermute_rope_rows

    reader = gguf.GGUFReader(path)
    arch = gguf_arch(reader)
    config = model.config
    parts: dict[str, dict[Any, tuple[str, np.ndarray]]] = {}
    embedding: tuple[str, np.ndarray] | None = None
    for tensor in reader.tensors:
        fmt = tensor.tensor_type.name
        hf_name = gguf_name_to_hf(tensor.name, arch)
        if hf_name is None or not hf_name.endswith(".weight"):
            continue
        data = np.asarray(tensor.data)
        if arch in ("llama", "mistral") and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            data = unpermute_rope_rows(data, heads)  # whole rows move: blocks run along the input dim
        if hf_name == "model.embed_tokens.weight":
            embedding = (fmt, data)
            if config.tie_word_embeddings:
                parts.setdefault("lm_head.weight", {})[None] = (fmt, data)
            continue
        route = model.checkpoint_route(hf_name)
        if route is not None:
            parts.setdefault(route[0], {})[route[1]] = (fmt, data)
    kept = 0
    modules = dict(model.named_modules())
    shared: dict[int, torch.Tensor] = {}  # one tensor for the tied embedding and head
    for param_name, by_part in parts.items():
        layer = modules.get(param_name.rsplit(".", 1)[0])
        if not isinstance(layer, Linear) or layer.method is not DENSE:
            continue
        order = list(layer.part_rows) if layer.part_rows else [None]
        if set(by_part) != set(order) or len({fmt for fmt, _ in by_part.values()}) != 1:
            continue  # a part missing or in another format: the layer stays dense
        fmt = next(iter(by_part.values()))[0]
        if fmt not in FORMATS:
            continue
        arrays = [by_part[p][1] for p in order]
        key = id(arrays[0]) if len(arrays) == 1 else None
        blocks = shared.get(key) if key is not None else None
        if blocks is None:
            blocks = torch.from_numpy(np.ascontiguousarray(np.concatenate(arrays, axis=0)))
            if key is not None:
                shared[key] = blocks
            kept += blocks.nbytes
        if blocks.shape[0] != layer.out_features or blocks.shape[1] != layer.in_features // 32 * FORMATS[fmt].block_bytes:
            continue
        dtype = layer.weight.dtype
        layer.register_buffer("gguf_blocks", blocks, persistent=False)
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        layer.method = _METHODS[(fmt, activations == "int8")]
    if embedding is not None and embedding[0] in FORMATS:
        inner = model.model
        dense = inner.embed_tokens.weight
        array = embedding[1]
        blocks = shared.get(id(array))
        if blocks is None:
            blocks = torch.from_numpy(np.ascontiguousarray(array))
            kept += blocks.nbytes
        if blocks.shape[0] == dense.shape[0]:
            inner.embed_tokens = QuantizedEmbedding(blocks, FORMATS[embedding[0]], dense.shape[1], dense.dtype)
    return kept
