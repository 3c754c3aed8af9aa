"""The batched LoRA matmul on CUDA: a grouped Triton shrink and expand (kernels/lora.py) as one opaque op.

The op (`engine::lora_sgmv`) keeps the launches out of dynamo's sight, so the compiled layer graphs the CUDA
decode runner captures hold it as one node with a fake shape, and the CUDA graph captures its two launches.
It is functional (a new output tensor): inductor then needs no reasoning about a mutated input, for one
activation-sized write that the expand kernel makes anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.cuda.triton_build import load_kernel
from engine.layers.ops import define_op
from engine.lora.matmul import TokenSlots

KERNELS = "backends.cuda.kernels.lora"


@dataclass(frozen=True)
class LoRATiles:
    block_m: int  # rows of one slot per program
    split_in: int  # input columns per shrink program (split-K)
    block_in: int  # input columns per dot
    block_k: int  # the stacked ranks of a slot, padded to a power of two (at least 16: tl.dot's minimum)
    block_out: int  # output columns per expand program
    num_warps: int = 4


def choose_tiles(rows: int, width: int) -> LoRATiles:
    """Row blocks that grow with the step (a decode step of one row still takes tl.dot's 16); narrow input
    splits while there are few row blocks, so a slot's A is streamed by many SMs at once, and long ones when the
    row blocks alone fill the GPU. Never tuned on a GPU (docs/lora.md)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 256 else 64
    return LoRATiles(
        block_m=block_m,
        split_in=256 if rows <= 64 else 2048,
        block_in=64,
        block_k=max(16, triton_next_power_of_2(width)),
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
) -> torch.Tensor:
    """out [T, N] + (x [T, in] @ lora_a[slot].T) @ lora_b[slot] for each row of a slot, float32 sums, in out's
    dtype; lora_a [S, K, in], lora_b [S, K, N] contiguous; sorted_rows and group_starts as engine/lora/rows.py
    keeps them (the rows of group S, the base model's and padding, are out's as they are)."""
    rows, in_features = x.shape
    num_slots, width, out_features = lora_b.shape
    if lora_a.shape != (num_slots, width, in_features) or out.shape != (rows, out_features):
        raise ValueError(
            f"LoRA shapes disagree: x {tuple(x.shape)}, out {tuple(out.shape)}, A {tuple(lora_a.shape)}, "
            f"B {tuple(lora_b.shape)}"
        )
    if not (lora_a.is_contiguous() and lora_b.is_contiguous()) or group_starts.shape != (num_slots + 2,):
        raise ValueError("LoRA slot stacks must be contiguous, and group_starts hold S + 2 offsets")
    y = torch.empty_like(out)
    if rows == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    out = out if out.stride(1) == 1 else out.contiguous()
    tiles = choose_tiles(rows, width)
    num_splits = -(-in_features // tiles.split_in)
    row_blocks = -(-rows // tiles.block_m)
    # float32 inputs (a float32 model) multiply exactly rather than in TF32; bf16/fp16 on the tensor cores.
    ieee_fp32 = x.dtype == torch.float32
    partial = torch.empty(num_splits, rows, width, dtype=torch.float32, device=x.device)
    shrink = load_kernel(KERNELS, "lora_shrink_kernel")
    shrink[(row_blocks, num_splits, num_slots)](
        x,
        lora_a,
        sorted_rows,
        group_starts,
        partial,
        rows,
        in_features,
        width,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        SPLIT_IN=tiles.split_in,
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        BLOCK_IN=tiles.block_in,
        IEEE_FP32=ieee_fp32,
        num_warps=tiles.num_warps,
    )
    expand = load_kernel(KERNELS, "lora_expand_kernel")
    expand[(row_blocks, -(-out_features // tiles.block_out), num_slots + 1)](
        out,
        partial,
        lora_b,
        sorted_rows,
        group_starts,
        y,
        rows,
        out_features,
        width,
        num_splits,
        num_slots,
        out.stride(0),
        y.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        BLOCK_OUT=tiles.block_out,
        IEEE_FP32=ieee_fp32,
        num_warps=tiles.num_warps,
    )
    return y


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _lora_sgmv_fake(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_rows: torch.Tensor,
    group_starts: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(out)


define_op(
    "lora_sgmv",
    "(Tensor out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor sorted_rows, Tensor group_starts) -> Tensor",
    lora_sgmv,
    _lora_sgmv_fake,
)


class TritonLoRA:
    """engine.lora.matmul.LoRAKernels through the grouped Triton kernels: each row block reads only its slot."""

    name = "triton_sgmv"
    grouped = True

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
    ) -> torch.Tensor:
        result: torch.Tensor = torch.ops.engine.lora_sgmv(out, x, lora_a, lora_b, rows.sorted_rows, rows.group_starts)
        return result


TRITON_LORA = TritonLoRA()
