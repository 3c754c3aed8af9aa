"""GGUF weights kept quantized on the CPU (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): a
linear method and an embedding.

The dense path dequantizes every GGUF tensor at load: SmolLM2's 98 MB Q4_1 file became 513 MiB of
float32 that each decode step streams. Here the linear layers keep the file's blocks, interleaved
16 rows at a time at load (kernels/gguf.h: the same bytes, laid out so one int8 dot-product
instruction covers 16 rows) and multiply through kernels/gguf_matmul*.c, which unpack each block
in registers: AVX512 (VNNI for int8 activations), AVX2 (256-bit VNNI where present), or portable C,
chosen at run time from what the CPU has (backends/cpu/features.py). A step of PREFILL_MIN_ROWS rows or more
multiplies by the layer's packed bf16 copy where it has one (prefill_weights.py: CPUs with native bf16); without
one, a bf16 or fp16 model's step with more rows than FUSED_MAX_ROWS dequantizes the matrix in C and runs the
GEMM in that dtype, and a float32 model runs the block kernels at every row count. The token embedding
gathers and dequantizes its rows; a tied LM head multiplies by the same tiles. The decode step of a
Llama-family model runs all of this in one native call (backends/cpu/gguf_decode.py).

Which tensors stay quantized: every part (q, k, v of a fused projection) in one of FORMATS, each
part in its own format (Q4_K_M and Q5_K_M files keep v and down in Q6_K). Others (F32 norms, IQ*,
...) load dense; with the native kernels off or unbuildable, everything loads dense (dequantized once).
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backends.cpu.features import cpu_features
from backends.cpu.native import load
from engine.layers.linear import DENSE, Linear
from engine.layers.ops import define_op

logger = logging.getLogger(__name__)

# Above this many rows (prefill) a bf16 or fp16 model dequantizes the matrix and runs oneDNN's GEMM in its dtype.
# A float32 model (the GGUF default) keeps the block kernels at every row count: dequantizing every matrix cost
# each prefill step ~150 ms on SmolLM2 (2 threads, AVX512), and the kernels also beat the float32 GEMM per token
# (17 / 128 / 512 / 2,000-token prompts: 37 / 146 / 888 / 8,289 ms against 176 / 333 / 1,212 / 9,399 ms).
FUSED_MAX_ROWS = 16
# A step of at least this many rows runs on the layer's packed bf16 copy when it has one
# (backends/cpu/prefill_weights.py, attached to its first tiles under PREFILL_WEIGHT_ATTR); fewer rows stream
# the blocks, which are a quarter of the bytes.
PREFILL_MIN_ROWS = 32
PREFILL_WEIGHT_ATTR = "_engine_prefill_bf16_packed"
# From this many rows such a step also runs the layers' MLPs on bf16 activations (DecoderForCausalLM.
# set_prefill_activations): a 1,500-token prompt in 1.85 s against 2.32 s, half the bytes staying in cache;
# short prompts would save a few milliseconds, and there float32 activations keep the logits nearer HF float32's
# (a 0.04 near-tie among logits of ~22 in the HF parity test's code prompt flipped under bf16 activations).
PREFILL_BF16_ACTIVATION_ROWS = 256


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # kernels/gguf.h's GG_* format
    block_columns: int  # weights per block of one row
    block_bytes: int


FORMATS = {
    "Q4_0": BlockFormat("Q4_0", 0, 32, 18),
    "Q4_1": BlockFormat("Q4_1", 1, 32, 20),
    "Q8_0": BlockFormat("Q8_0", 2, 32, 34),
    "Q4_K": BlockFormat("Q4_K", 3, 256, 144),
    "Q6_K": BlockFormat("Q6_K", 4, 256, 210),
    "Q5_0": BlockFormat("Q5_0", 5, 32, 22),
    "Q5_1": BlockFormat("Q5_1", 6, 32, 24),
    "Q5_K": BlockFormat("Q5_K", 7, 256, 176),
    "Q3_K": BlockFormat("Q3_K", 8, 256, 110),
    "Q2_K": BlockFormat("Q2_K", 9, 256, 84),
}
PATH_NAMES = {0: "portable C", 1: "AVX2", 2: "256-bit VNNI", 3: "AVX512"}  # kernels/gguf.h's GG_PORTABLE ..
# --gguf-activations: how the block kernels take their inputs (decode, and a float32 model's prefill), as the
# kernels' activation levels: float32 (exact), int8x2 (each block of 32 as two int8 levels: ~16-bit,
# integer dot products) or int8 (llama.cpp's numerics: one int8 level).
ACTIVATIONS = {"float32": 0, "int8": 1, "int8x2": 2}


class GGMatrix(ctypes.Structure):
    """kernels/gguf.h's gg_matrix: one matrix in the tiled layout."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("format", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


@cache
def _library() -> Any:
    lib = load("gguf")
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    for name, restype, argtypes in (
        ("gguf_tiled_bytes", ctypes.c_int64, [i, i, i]),
        ("gguf_repack", i, [i, p, p, i, i, i]),
        ("gguf_dequantize", i, [p, p, i]),
        ("gguf_dequantize_rows", i, [p, p, i, p]),
        ("gguf_matmul", i, [p, i, p, i, p, i, i, i]),  # parts, nparts, x, m, y, levels, path, threads
        ("gguf_paths", i, []),
        ("gguf_quantized_activations", i, [p, i, i, i, i, p]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def gguf_kernels_available() -> bool:
    return _library() is not None


class CodePaths(NamedTuple):
    float32: int  # the path float32 activations take (PATH_NAMES)
    int8: int  # and int8 activations


@cache
def code_paths() -> CodePaths:
    """The best path of each kind that this build has and the CPU shows (ENGINE_CPU_HIDE_FEATURES hides
    features from it). Decided once: every linear of every step asks."""
    lib = _library()
    if lib is None:
        return CodePaths(0, 0)
    built, cpu = lib.gguf_paths(), cpu_features()
    avx2 = bool(built & 2) and cpu.has("avx2", "fma3", "f16c")
    avx512 = avx2 and cpu.avx512
    vnni256 = avx2 and bool(built & 4) and (cpu.has("avx_vnni") or cpu.has("avx512_vnni", "avx512_vl"))
    float32 = 3 if avx512 and built & 8 else 1 if avx2 else 0
    int8 = 3 if avx512 and built & 16 and cpu.has("avx512_vnni") else 2 if vnni256 else 1 if avx2 else 0
    return CodePaths(float32, int8)


def describe_paths() -> str:
    paths = code_paths()
    return f"float32 activations {PATH_NAMES[paths.float32]}, int8 activations {PATH_NAMES[paths.int8]}"


def _matrix(tiles: torch.Tensor, code: int, rows: int, cols: int) -> GGMatrix:
    return GGMatrix(tiles.data_ptr(), code, rows, cols, 0)


def tiled_shape(fmt: BlockFormat, blocks: np.ndarray) -> tuple[int, int]:
    """(row groups of 16, bytes a group) of a GGUF tensor's blocks [rows, cols / block_columns * block_bytes]
    in the tiled layout of kernels/gguf.h: the same bytes interleaved (Q4_K 2.8% more, Q5_K 2.3%, Q3_K 3.6%:
    their 6-bit scales widened; Q2_K's the same bytes; a last group padded with zero rows)."""
    rows = blocks.shape[0]
    cols = blocks.shape[1] // fmt.block_bytes * fmt.block_columns
    size = _library().gguf_tiled_bytes(fmt.code, rows, cols)
    if size < 0 or blocks.shape[1] % fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks of shape {blocks.shape} do not tile")
    groups = -(-rows // 16)
    return groups, size // groups


def tile_blocks(fmt: BlockFormat, blocks: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks in the tiled layout (tiled_shape), written into `out` (uint8 of that many bytes) or a
    new tensor."""
    shape = tiled_shape(fmt, blocks)
    tiles = torch.empty(shape, dtype=torch.uint8) if out is None else out.view(shape)
    source = np.ascontiguousarray(blocks, dtype=np.uint8)
    rows, cols = blocks.shape[0], blocks.shape[1] // fmt.block_bytes * fmt.block_columns
    if _library().gguf_repack(fmt.code, source.ctypes.data, tiles.data_ptr(), rows, cols, torch.get_num_threads()) != 0:
        raise ValueError(f"{fmt.name} repack refused shape [{rows}, {cols}]")
    return tiles


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """nbytes of uint8 starting on a 2 MiB boundary and advised for transparent huge pages (the kernel's
    THP mode here is "madvise": without asking, weights get 4 KiB pages). A decode step streams every
    tile once: with 4 KiB pages that is ~24,000 TLB entries for SmolLM2's 92 MiB; with 2 MiB pages
    46. Measured on 90 MiB of Q4_1 tiles, int8x2, 2 threads: 2.72 -> 2.42 ms. The advice is a hint:
    refused (another OS, THP off) the arena is ordinary memory."""
    raw = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)  # untouched slack costs no memory
    offset = (-raw.data_ptr()) % HUGE_PAGE
    arena = raw[offset : offset + nbytes]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(
            ctypes.c_void_p(arena.data_ptr()), ctypes.c_size_t(-(-nbytes // HUGE_PAGE) * HUGE_PAGE), MADV_HUGEPAGE
        )
    except (OSError, AttributeError):
        pass
    return arena


def dequantize_tiles(tiles: torch.Tensor, code: int, rows: int, cols: int) -> torch.Tensor:
    """The float32 [rows, cols] matrix the tiles hold."""
    out = torch.empty(rows, cols, dtype=torch.float32)
    matrix = _matrix(tiles, code, rows, cols)
    if _library().gguf_dequantize(ctypes.byref(matrix), out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"GGUF dequantize refused shape [{rows}, {cols}]")
    return out


def gguf_linear(
    x: torch.Tensor, tiles: Sequence[torch.Tensor], codes: Sequence[int], rows: Sequence[int], levels: int = 0
) -> torch.Tensor:
    """x [..., in] @ W.T with W's row parts in tiles (codes: their formats, rows: their heights), in
    x's dtype, accumulated in float32. levels (ACTIVATIONS): 0 float32 activations, 1 or 2: each row
    quantized to one or two int8 levels per block of 32, then integer dot products."""
    cols = x.shape[-1]
    flat = x.reshape(-1, cols)
    packed = getattr(tiles[0], PREFILL_WEIGHT_ATTR, None)
    if packed is not None and flat.shape[0] >= PREFILL_MIN_ROWS:
        # A prefill with a packed bf16 copy (backends/cpu/prefill_weights.py): oneDNN's bf16 GEMM (AVX512-BF16
        # or AMX) multiplies many rows faster than the block kernels unpack them.
        out = torch.ops.mkldnn._linear_pointwise(flat.to(torch.bfloat16), packed, None, "none", [], "")
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
    if flat.shape[0] > FUSED_MAX_ROWS and x.dtype != torch.float32:
        # A bf16/fp16 prefill: one dequantized matrix serves every row, and oneDNN's GEMM in that dtype is fast.
        weight = torch.cat([dequantize_tiles(t, c, r, cols) for t, c, r in zip(tiles, codes, rows)]).to(x.dtype)
        return F.linear(x, weight)
    x32 = flat.to(torch.float32).contiguous()
    out = torch.empty(flat.shape[0], sum(rows), dtype=torch.float32)
    parts = (GGMatrix * len(tiles))(*(_matrix(t, c, r, cols) for t, c, r in zip(tiles, codes, rows)))
    paths = code_paths()
    status = _library().gguf_matmul(
        parts,
        len(tiles),
        x32.data_ptr(),
        flat.shape[0],
        out.data_ptr(),
        levels,
        paths.int8 if levels else paths.float32,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"GGUF matmul refused x {tuple(x.shape)} by parts {list(rows)} x {cols}")
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def quantized_activations(x: torch.Tensor, levels: int, path: int = 0) -> torch.Tensor:
    """x [m, k] float32 as the int8 kernels see it (float64): per block of 32, one or two int8 levels
    times their scales (kernels/gguf_matmul.c's quantizer, through code path `path`)."""
    x32 = x.to(torch.float32).contiguous()
    out = torch.empty(x32.shape, dtype=torch.float64)
    lib = _library()
    if lib.gguf_quantized_activations(x32.data_ptr(), x32.shape[0], x32.shape[1], levels, path, out.data_ptr()) != 0:
        raise ValueError(f"cannot quantize activations of shape {tuple(x.shape)} to {levels} levels")
    return out


def _gguf_linear_fake(x, tiles, codes, rows, levels=0):
    return x.new_empty((*x.shape[:-1], sum(rows)))


define_op(
    "gguf_linear",
    "(Tensor x, Tensor[] tiles, int[] codes, int[] rows, int levels=0) -> Tensor",
    gguf_linear,
    _gguf_linear_fake,
)


def gguf_embedding(ids: torch.Tensor, tiles: torch.Tensor, code: int, vocab: int, dim: int) -> torch.Tensor:
    """Rows ids of the tiled [vocab, dim] matrix, float32 [*ids.shape, dim]."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], dim, dtype=torch.float32)
    matrix = _matrix(tiles, code, vocab, dim)
    if _library().gguf_dequantize_rows(ctypes.byref(matrix), flat.data_ptr(), flat.shape[0], out.data_ptr()) != 0:
        raise IndexError(f"token id out of range [0, {vocab})")
    return out.reshape(*ids.shape, dim)


def _gguf_embedding_fake(ids, tiles, code, vocab, dim):
    return torch.empty((*ids.shape, dim), dtype=torch.float32, device=ids.device)


define_op(
    "gguf_embedding",
    "(Tensor ids, Tensor tiles, int code, int vocab, int dim) -> Tensor",
    gguf_embedding,
    _gguf_embedding_fake,
)


class GGUFLinearMethod:
    """engine.layers.linear.LinearMethod over the layer's `gguf_tiles_<i>` buffers (`gguf_parts`: per
    part, its format and rows); `activations`: a key of ACTIVATIONS."""

    def __init__(self, activations: str = "float32") -> None:
        self.activations = activations
        self.levels = ACTIVATIONS[activations]
        self.name = "gguf" if activations == "float32" else f"gguf_{activations}_activations"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        parts = layer.gguf_parts
        tiles = [getattr(layer, f"gguf_tiles_{i}") for i in range(len(parts))]
        out = torch.ops.engine.gguf_linear(
            x, tiles, [f.code for f, _ in parts], [rows for _, rows in parts], self.levels
        )
        return out if layer.bias is None else out + layer.bias


_METHODS = {name: GGUFLinearMethod(name) for name in ACTIVATIONS}


def gguf_tiles(layer: nn.Module) -> list[tuple[BlockFormat, int, torch.Tensor]]:
    """(format, rows, tiles) of each part of a Linear kept in GGUF blocks (empty for any other)."""
    parts = getattr(layer, "gguf_parts", ())
    return [(fmt, rows, getattr(layer, f"gguf_tiles_{i}")) for i, (fmt, rows) in enumerate(parts)]


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over GGUF tiles [vocab rows]: gathered rows dequantized."""

    def __init__(self, tiles: torch.Tensor, fmt: BlockFormat, vocab: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("gguf_tiles", tiles, persistent=False)
        self.fmt, self.vocab, self.dim, self.dtype = fmt, vocab, dim, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.engine.gguf_embedding(input_ids, self.gguf_tiles, self.fmt.code, self.vocab, self.dim)
        return rows.to(self.dtype)


def keep_gguf_blocks(model: nn.Module, path: str, activations: str = "float32") -> int:
    """Switch every Linear (and the token embedding) whose GGUF tensors all have a kernel format to
    their tiles, freeing the dense weights; returns the bytes of tiles kept. activations: how the
    decode kernels take their inputs (ACTIVATIONS)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"GGUF activations must be one of {ACTIVATIONS}, got {activations!r}")
    from engine.loader.weights import gguf_arch, gguf_name_to_hf, gguf_rope_permuted, open_gguf, unpermute_rope_rows

    reader = open_gguf(path)
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
        if gguf_rope_permuted(arch) and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
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
    # Which layers take which arrays (the tied embedding and head: one array, one copy of its tiles).
    modules = dict(model.named_modules())
    plan: list[tuple[Linear, list[tuple[BlockFormat, np.ndarray]]]] = []
    for param_name, by_part in parts.items():
        layer = modules.get(param_name.rsplit(".", 1)[0])
        if not isinstance(layer, Linear) or layer.method is not DENSE:
            continue
        order = list(layer.part_rows) if layer.part_rows else [None]
        if set(by_part) != set(order) or any(fmt not in FORMATS for fmt, _ in by_part.values()):
            continue  # a part missing or in a format without a kernel: the layer stays dense
        pieces = [(FORMATS[by_part[p][0]], by_part[p][1]) for p in order]
        if sum(a.shape[0] for _, a in pieces) != layer.out_features or any(
            a.shape[1] != layer.in_features // f.block_columns * f.block_bytes for f, a in pieces
        ):
            continue
        plan.append((layer, pieces))
    dense_embedding = model.model.embed_tokens.weight
    if embedding is None or embedding[0] not in FORMATS or embedding[1].shape[0] != dense_embedding.shape[0]:
        embedding = None
    arrays = {id(a): (f, a) for _, pieces in plan for f, a in pieces}
    if embedding is not None:
        arrays[id(embedding[1])] = (FORMATS[embedding[0]], embedding[1])
    # Every tile tensor carved out of one huge-page arena (64-byte aligned slices).
    sizes = {key: math.prod(tiled_shape(f, a)) for key, (f, a) in arrays.items()}
    offsets, total = {}, 0
    for key, size in sizes.items():
        offsets[key] = total
        total += -(-size // 64) * 64
    arena = huge_page_arena(total) if total else None
    tiles = {key: tile_blocks(f, a, arena[offsets[key] : offsets[key] + sizes[key]]) for key, (f, a) in arrays.items()}
    method = _METHODS[activations]
    for layer, pieces in plan:
        layer.gguf_parts = tuple((f, a.shape[0]) for f, a in pieces)
        for i, (_, array) in enumerate(pieces):
            layer.register_buffer(f"gguf_tiles_{i}", tiles[id(array)], persistent=False)
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
        layer.method = method
    if embedding is not None:
        model.model.embed_tokens = QuantizedEmbedding(
            tiles[id(embedding[1])],
            FORMATS[embedding[0]],
            dense_embedding.shape[0],
            dense_embedding.shape[1],
            dense_embedding.dtype,
        )
    return sum(sizes.values())
