"""The batched LoRA matmul on CUDA: grouped Triton kernels (kernels/lora.py) as one opaque, in-place op.

`engine::lora_sgmv(Tensor(a!) out, ...) -> ()` adds each slot row's adapter product into `out` and touches no
other row: the base model's rows and a graph's padding are never read or written, so a step of base rows costs
the launch and its programs returning at once, not a copy of the activation. The op keeps the launches out of
dynamo's sight, so the compiled layer graphs the CUDA decode runner captures hold it as one node and the CUDA
graph captures its launches. Under torch.compile, functionalization wraps the mutation (`auto_functionalized`)
and inductor's reinplacing runs the op on the base projection's own output buffer, with no copy, since nothing
reads that buffer's old values (tests/test_lora_kernels.py checks the generated code).

Each projection is two launches, the split-K shrink and the expand (kernels/lora.py says why not one), or only the
expand (`engine::lora_expand`) where A is folded into the base weight and the base matmul made the low-rank rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends.cuda.triton_build import compile_only, load_kernel
from engine.layers.ops import define_op
from engine.lora.layers import LoRALinearMethod
from engine.lora.matmul import TokenSlots

KERNELS = "backends.cuda.kernels.lora"

SPLIT_PROGRAMS = 512
"""About how many shrink programs a step should keep busy (a few per SM of an H100): the input is split into
enough parts for the row blocks that can hold rows to reach this many, so a decode step's few rows still
spread each slot's A over the GPU. Never tuned on a GPU."""

MIN_SPLIT_IN = 256  # input columns per shrink program at the least: shorter splits are mostly partial sums


@dataclass(frozen=True)
class SplitTiles:
    block_m: int  # rows of one slot per program
    split_in: int  # input columns per shrink program (split-K)
    block_in: int  # input columns per dot
    block_k: int  # the stacked ranks of a slot, padded to a power of two (at least 16: tl.dot's minimum)
    block_out: int  # output columns per expand program
    num_warps: int = 4


def live_blocks(rows: int, num_slots: int, block_m: int) -> int:
    """The most blocks of block_m rows the slots' rows fill, each slot's from a block boundary: the grids' first
    dimension. Slot s's c_s rows take ceil(c_s / block_m) blocks, whose sum is at most S + (rows - 1) // block_m;
    each block holds a row, so there are never more than the rows."""
    return max(1, min(rows, num_slots + (rows - 1) // block_m))


def split_tiles(rows: int, num_slots: int, width: int, in_features: int) -> SplitTiles:
    """Row blocks that grow with the step; the input split so that about SPLIT_PROGRAMS shrink programs hold
    rows (each slot's rows take ceil(n / block_m) blocks: at most S + (rows - 1) // block_m of them), which is
    many narrow splits for a decode step and few long ones for a prefill, whose row blocks fill the GPU alone."""
    block_m = 16 if rows <= 16 else 32 if rows <= 256 else 64
    block_in = 64
    live = live_blocks(rows, num_slots, block_m)
    max_splits = max(1, -(-in_features // MIN_SPLIT_IN))
    splits = min(max_splits, -(-SPLIT_PROGRAMS // live))
    split_in = -(-in_features // splits)
    return SplitTiles(
        block_m=block_m,
        split_in=-(-split_in // block_in) * block_in,
        block_in=block_in,
        block_k=max(16, next_power_of_2(width)),
        block_out=128 if width <= 64 else 64,
        num_warps=4 if width <= 64 else 8,  # wide stacks (high ranks): [rows, K] accumulators over more threads
    )


def lora_sgmv(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_rows: torch.Tensor,
    group_starts: torch.Tensor,
) -> None:
    """out[t] += (x[t] @ lora_a[slot].T) @ lora_b[slot] in place for each row t of a slot, float32 sums rounded
    once to out's dtype; out [T, N], x [T, in], lora_a [S, K, in], lora_b [S, K, N] contiguous; sorted_rows and
    group_starts as engine/lora/rows.py keeps them. The rows of group S (the base model's and padding) are
    never read or written."""
    rows, in_features = x.shape
    num_slots, width, out_features = lora_b.shape
    if lora_a.shape != (num_slots, width, in_features) or out.shape != (rows, out_features):
        raise ValueError(
            f"LoRA shapes disagree: x {tuple(x.shape)}, out {tuple(out.shape)}, A {tuple(lora_a.shape)}, "
            f"B {tuple(lora_b.shape)}"
        )
    if not (lora_a.is_contiguous() and lora_b.is_contiguous()) or group_starts.shape != (num_slots + 2,):
        raise ValueError("LoRA slot stacks must be contiguous, and group_starts hold S + 2 offsets")
    if rows == 0 or num_slots == 0 or width == 0 or out_features == 0:
        return  # nothing to add (an empty grid is not a launch Triton takes)
    x = x if x.stride(1) == 1 else x.contiguous()  # read only: a copy will do; out is written where it lies
    # Two launches: the split-K shrink into float32 partial sums, then the expand adding into out.
    tiles = split_tiles(rows, num_slots, width, in_features)
    num_splits = -(-in_features // tiles.split_in)
    ieee_fp32 = x.dtype == torch.float32  # a float32 model multiplies exactly rather than in TF32
    partial = torch.empty(num_splits, rows, width, dtype=torch.float32, device=x.device)
    load_kernel(KERNELS, "lora_shrink_kernel")[(live_blocks(rows, num_slots, tiles.block_m), num_splits)](
        x,
        lora_a,
        sorted_rows,
        group_starts,
        partial,
        rows,
        num_slots,
        in_features,
        width,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        tiles.split_in,
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        BLOCK_IN=tiles.block_in,
        SLOTS=next_power_of_2(num_slots),
        IEEE_FP32=ieee_fp32,
        num_warps=tiles.num_warps,
    )
    _expand(out, partial, lora_b, sorted_rows, group_starts, tiles, num_splits, (rows * width, width, 0))


def _expand(
    out: torch.Tensor,
    partial: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_rows: torch.Tensor,
    group_starts: torch.Tensor,
    tiles: SplitTiles,
    num_splits: int,
    partial_strides: tuple[int, int, int],
) -> None:
    """The expand launch: partial_strides are (split, row, slot) strides of the low-rank sums it reads."""
    rows, out_features = out.shape
    num_slots, width, _ = lora_b.shape
    grid = (live_blocks(rows, num_slots, tiles.block_m), -(-out_features // tiles.block_out))
    load_kernel(KERNELS, "lora_expand_kernel")[grid](
        out,
        partial,
        lora_b,
        sorted_rows,
        group_starts,
        rows,
        num_slots,
        out_features,
        width,
        num_splits,
        *partial_strides,
        out.stride(0),
        out.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        BLOCK_OUT=tiles.block_out,
        SLOTS=next_power_of_2(num_slots),
        IEEE_FP32=out.dtype == torch.float32,
        num_warps=tiles.num_warps,
    )


def lora_expand(
    out: torch.Tensor,
    low_rank: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_rows: torch.Tensor,
    group_starts: torch.Tensor,
) -> None:
    """out[t] += low_rank[t, slot*K : (slot+1)*K] @ lora_b[slot] in place for each row t of a slot (A folded into
    the base weight: low_rank holds every slot's columns); out and low_rank may be column slices of one tensor
    (any row stride, unit column stride). Rows of group S are never read or written."""
    rows, out_features = out.shape
    num_slots, width, b_out = lora_b.shape
    if low_rank.shape != (rows, num_slots * width) or b_out != out_features:
        raise ValueError(
            f"LoRA expand shapes disagree: out {tuple(out.shape)}, low rank {tuple(low_rank.shape)}, "
            f"B {tuple(lora_b.shape)}"
        )
    if not lora_b.is_contiguous() or low_rank.stride(1) != 1 or group_starts.shape != (num_slots + 2,):
        raise ValueError("LoRA expand: B contiguous, low-rank columns unit-strided, group_starts S + 2 offsets")
    if rows == 0 or num_slots == 0 or width == 0 or out_features == 0:
        return
    tiles = split_tiles(rows, num_slots, width, width)
    _expand(out, low_rank, lora_b, sorted_rows, group_starts, tiles, 1, (0, low_rank.stride(0), width))


ROW_CLASSES = (1, 2, 16, 17, 32, 257, 272)
"""Row counts of every kernel variant a step may launch: the row block is 16 up to 16 rows, 32 up to 256, 64
above, and Triton specializes an integer argument on being 1 or a multiple of 16 (the rows and strides built
from them), so each block's range takes a count of each kind."""


def precompile_lora(model: nn.Module) -> int:
    """Compile ahead (compile_only launches, in the background while the decode step compiles) the Triton LoRA
    kernels of every LoRA projection, at a row count of each variant a step launches (ROW_CLASSES): the shrink
    and the expand, or the expand alone where A is folded into the base weight. Without it each variant compiled
    at its first launch, one after another, in the middle of capturing the graphs. Returns the launches made."""
    seen: set[tuple] = set()
    with compile_only():
        for module in model.modules():
            method = getattr(module, "method", None)
            if not isinstance(method, LoRALinearMethod) or method.kernels is not TRITON_LORA:
                continue
            lora_a: torch.Tensor = module.lora_a  # type: ignore[assignment]
            lora_b: torch.Tensor = module.lora_b  # type: ignore[assignment]
            num_slots, width, out_features = lora_b.shape
            in_features = lora_a.shape[-1]
            key = (method.folded, tuple(lora_b.shape), in_features, lora_b.dtype)
            if key in seen:
                continue
            seen.add(key)
            device, dtype = lora_b.device, lora_b.dtype
            sorted_rows = torch.zeros(ROW_CLASSES[-1], dtype=torch.int64, device=device)
            group_starts = torch.zeros(num_slots + 2, dtype=torch.int64, device=device)
            for rows in ROW_CLASSES:
                if method.folded:
                    both = torch.empty(rows, out_features + num_slots * width, dtype=dtype, device=device)
                    lora_expand(both[:, :out_features], both[:, out_features:], lora_b, sorted_rows, group_starts)
                else:
                    out = torch.empty(rows, out_features, dtype=dtype, device=device)
                    x = torch.empty(rows, in_features, dtype=dtype, device=device)
                    lora_sgmv(out, x, lora_a.contiguous(), lora_b, sorted_rows, group_starts)
    return len(seen) * len(ROW_CLASSES) * 2


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _only_out_mutated(*tensors: torch.Tensor) -> None:
    """Both ops' fake: nothing to return, their only effect is on `out`, which the schema marks mutated."""


define_op(
    "lora_expand",
    "(Tensor(a!) out, Tensor low_rank, Tensor lora_b, Tensor sorted_rows, Tensor group_starts) -> ()",
    lora_expand,
    _only_out_mutated,
)
define_op(
    "lora_sgmv",
    "(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor sorted_rows, Tensor group_starts) -> ()",
    lora_sgmv,
    _only_out_mutated,
)


class TritonLoRA:
    """engine.lora.matmul.LoRAKernels through the grouped Triton kernels: each row block reads only its slot, and
    the result is `out` itself, written in place (its rows of slot -1 untouched)."""

    name = "triton_sgmv"
    grouped = True

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
    ) -> torch.Tensor:
        torch.ops.engine.lora_sgmv(out, x, lora_a, lora_b, rows.sorted_rows, rows.group_starts)
        return out

    def expand(self, out: torch.Tensor, low_rank: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots) -> torch.Tensor:
        torch.ops.engine.lora_expand(out, low_rank, lora_b, rows.sorted_rows, rows.group_starts)
        return out


TRITON_LORA = TritonLoRA()
