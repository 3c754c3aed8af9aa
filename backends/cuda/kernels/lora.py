"""Triton source of the batched LoRA matmul (imported only through backends.cuda.lora).

Punica's SGMV as vLLM's Triton LoRA kernels shape it: the step's token rows grouped by adapter slot (the
model runner lists them on the host, engine/lora/rows.py), and each program multiplies a block of one slot's
rows by that slot's matrices with tensor-core dots. The slot stacks are lora_a [S, K, IN] and lora_b
[S, K, OUT] (K = parts * max rank), so a step reads only the slots its rows use, never all S.

- shrink, grid (row blocks, input splits, S): partial[split, row, :] = x[row, split's columns] @
  A[slot, :, those columns].T. Split-K over the input, each split into its own partial sums: no atomics and no
  zeroed buffer, and the sum does not depend on the order programs run in. Decode steps have few rows, so the
  splits are what spreads a slot's A over the SMs.
- expand, grid (row blocks, output blocks, S + 1): y[row, block] = out[row, block] + (sum over splits of
  partial[:, row]) @ B[slot, :, block]; the last group (S) is the base model's rows and the rows a graph pads
  with, copied through.

The grid is fixed by the step's row count and S: a program whose block lies past its slot's rows returns at
once. The row lists and group offsets are read on the device, so the launches are the same for every mix of
adapters and need no host synchronisation: both run inside captured CUDA graphs.
"""

import triton
import triton.language as tl


@triton.jit
def _slot_block(sorted_rows_ptr, group_starts_ptr, slot, block, rows, BLOCK_M: tl.constexpr):
    """Block `block` of slot `slot`'s rows: (their token rows, which are live, whether the block is past them)."""
    start = tl.load(group_starts_ptr + slot)
    end = tl.minimum(tl.load(group_starts_ptr + slot + 1), rows)
    first = start + block * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    token = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    return token, m_mask & (token < rows), first >= end  # never past the rows given, whatever the lists say


@triton.jit(do_not_specialize=["rows", "IN", "K"])
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    sorted_rows_ptr,
    group_starts_ptr,
    partial_ptr,
    rows,
    IN,
    K,
    stride_x,
    stride_a_slot,
    stride_a_k,
    SPLIT_IN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.program_id(2)
    token, m_mask, empty = _slot_block(sorted_rows_ptr, group_starts_ptr, slot, block, rows, BLOCK_M)
    if empty:
        return
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    offs_in = tl.arange(0, BLOCK_IN)
    x_rows = x_ptr + token[:, None] * stride_x
    a_cols = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_k[None, :].to(tl.int64) * stride_a_k
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for col in range(split * SPLIT_IN, split * SPLIT_IN + SPLIT_IN, BLOCK_IN):
        cols = col + offs_in
        in_mask = cols < IN
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & in_mask[None, :], other=0.0)
        a = tl.load(a_cols + cols[:, None], mask=in_mask[:, None] & k_mask[None, :], other=0.0)  # [IN, K] tile
        if IEEE_FP32:
            acc += tl.dot(x, a.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))
    partial = partial_ptr + (split * rows + token[:, None]) * K + offs_k[None, :]
    tl.store(partial, acc, mask=m_mask[:, None] & k_mask[None, :])


@triton.jit(do_not_specialize=["rows", "OUT", "K", "num_splits"])
def lora_expand_kernel(
    out_ptr,
    partial_ptr,
    b_ptr,
    sorted_rows_ptr,
    group_starts_ptr,
    y_ptr,
    rows,
    OUT,
    K,
    num_splits,
    num_slots,
    stride_out,
    stride_y,
    stride_b_slot,
    stride_b_k,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    out_block = tl.program_id(1)
    slot = tl.program_id(2)  # num_slots: the base model's rows and padding
    token, m_mask, empty = _slot_block(sorted_rows_ptr, group_starts_ptr, slot, block, rows, BLOCK_M)
    if empty:
        return
    offs_n = out_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    mask = m_mask[:, None] & (offs_n < OUT)[None, :]
    result = tl.load(out_ptr + token[:, None] * stride_out + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if slot < num_slots:
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        partial = partial_ptr + token[:, None] * K + offs_k[None, :]
        pk_mask = m_mask[:, None] & k_mask[None, :]
        low_rank = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for split in range(num_splits):
            low_rank += tl.load(partial + split * rows * K, mask=pk_mask, other=0.0)
        b_rows = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_k[:, None].to(tl.int64) * stride_b_k
        b = tl.load(b_rows + offs_n[None, :], mask=k_mask[:, None] & (offs_n < OUT)[None, :], other=0.0)
        # The low-rank rows in B's dtype, as a torch bf16 matmul would round them, then a tensor-core dot.
        if IEEE_FP32:
            result += tl.dot(low_rank.to(b.dtype), b, input_precision="ieee")
        else:
            result += tl.dot(low_rank.to(b.dtype), b)
    tl.store(y_ptr + token[:, None] * stride_y + offs_n[None, :], result.to(y_ptr.dtype.element_ty), mask=mask)
