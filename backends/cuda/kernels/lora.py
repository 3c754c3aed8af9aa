"""Triton source of the batched LoRA matmul (imported only through backends.cuda.lora).

Punica's SGMV as vLLM's Triton LoRA kernels shape it: the step's token rows grouped by adapter slot (the
model runner lists them on the host, engine/lora/rows.py), and each program multiplies a block of one slot's
rows by that slot's matrices with tensor-core dots. The slot stacks are lora_a [S, K, IN] and lora_b
[S, K, OUT] (K = parts * max rank), so a step reads only the slots its rows use, never all S.

Every kernel adds into `out` in place, and only into the rows of a slot: no program is launched for the base
model's rows and the rows a graph pads with (the last group of sorted_rows), so those are never read or
written. Each (row, output column) belongs to exactly one program, so the adds need no atomics.

- shrink, grid (live row blocks, input splits): partial[split, row, :] = x[row, split's columns] @
  A[slot, :, those columns].T, split-K over the input, each split into its own partial sums (no atomics and no
  zeroed buffer, and the sum does not depend on the order programs run in). The splits are what spreads a slot's
  A over the SMs when a step has few row blocks (decode).
- expand, grid (live row blocks, output blocks): out[row, block] += (sum over splits of partial[:, row]) @
  B[slot, :, block]. Where A is folded into the base weight (engine/lora/layers.py), the base matmul's extra
  columns are the low-rank rows, every slot's side by side: the expand alone runs, reading its slot's K columns
  of them (one "split").

A fused kernel (each program recomputing its row block's shrink over the whole input, then its part of the
expand: one launch instead of two) was built and measured on an H100 at batch 1: 14.2 ms a Llama-3-8B decode
step against 7.7 with these two, since each program streamed its slot's whole A through one SM. So two launches.

Sums are float32; the low-rank rows are rounded to B's dtype before the expand's dot, as a torch bf16 matmul
would round them. The grids are fixed by the step's row count and S: their first dimension counts the blocks
of BLOCK_M rows the slots' rows can fill at most (each slot's rows from a block boundary: at most S + (rows -
1) // BLOCK_M, and never more than the rows), and each program finds its slot and block by walking the
slots' row counts; a program past the step's blocks returns at once. (A grid of every row block for every
slot launched S times the programs, at batch 1 all but one per output block returning at once.) The row lists
and group offsets are read on the device, so the launches are the same for every mix of adapters and need no
host synchronisation: they run inside captured CUDA graphs.
"""

import triton
import triton.language as tl


@triton.jit
def _live_block(
    sorted_rows_ptr, group_starts_ptr, live_block, num_slots, rows, BLOCK_M: tl.constexpr, SLOTS: tl.constexpr
):
    """Block number `live_block` of the slots' rows, counted slot after slot in blocks of BLOCK_M rows: (its
    slot, its token rows, which are live, whether it lies past every slot's rows). The grid holds only as many
    blocks as the step's rows can fill, never a block per slot that no row uses. Every slot's offsets come in
    one vector load (SLOTS: num_slots padded to a power of two), so finding the block costs one load's
    latency, not one per slot."""
    s = tl.arange(0, SLOTS)
    valid = s < num_slots
    starts = tl.load(group_starts_ptr + s, mask=valid, other=0)
    ends = tl.minimum(tl.load(group_starts_ptr + s + 1, mask=valid, other=0), rows)
    blocks = tl.where(valid, (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M, 0)
    through = tl.cumsum(blocks, axis=0)  # blocks of slots 0..s
    before = through - blocks
    here = valid & (live_block >= before) & (live_block < through)
    slot = tl.sum(tl.where(here, s, 0), axis=0)
    first = tl.sum(tl.where(here, starts + (live_block - before) * BLOCK_M, 0), axis=0)
    end = tl.sum(tl.where(here, ends, 0), axis=0)
    found = tl.sum(here.to(tl.int32), axis=0)  # 1, or 0 past every slot's blocks
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = (offs_m < end) & (found > 0)
    token = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, token, m_mask & (token < rows), found == 0  # never past the rows given, whatever the lists say


@triton.jit
def _shrink(
    x_rows,
    a_cols,
    m_mask,
    k_mask,
    start,
    stop,
    IN,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """x[rows, start:stop] @ A[slot, :, start:stop].T, float32 [BLOCK_M, BLOCK_K]: x_rows points at the block's
    rows of x [BLOCK_M, 1], a_cols at the slot's K rows of A [1, BLOCK_K]."""
    offs_in = tl.arange(0, BLOCK_IN)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for col in range(start, stop, BLOCK_IN):
        cols = col + offs_in
        in_mask = cols < IN
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & in_mask[None, :], other=0.0)
        a = tl.load(a_cols + cols[:, None], mask=in_mask[:, None] & k_mask[None, :], other=0.0)  # [IN, K] tile
        # float32 inputs (a float32 model) multiply exactly rather than in TF32; bf16/fp16 on the tensor cores.
        if IEEE_FP32:
            acc += tl.dot(x, a.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))
    return acc


@triton.jit
def _add_expand(
    out_ptr,
    stride_out,
    stride_out_n,
    token,
    m_mask,
    low_rank,
    b_rows,
    k_mask,
    offs_n,
    OUT,
    IEEE_FP32: tl.constexpr,
):
    """out[rows, offs_n] += low_rank @ B[slot, :, offs_n], in place: low_rank [BLOCK_M, BLOCK_K] already in B's
    dtype, b_rows the slot's K rows of B [BLOCK_K, 1]. The sum is float32, rounded once to out's dtype."""
    n_mask = offs_n < OUT
    b = tl.load(b_rows + offs_n[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    if IEEE_FP32:
        delta = tl.dot(low_rank, b, input_precision="ieee")
    else:
        delta = tl.dot(low_rank, b)
    mask = m_mask[:, None] & n_mask[None, :]
    target = out_ptr + token[:, None] * stride_out + offs_n[None, :] * stride_out_n
    result = tl.load(target, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(target, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows", "num_slots", "IN", "K", "split_in"])
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    sorted_rows_ptr,
    group_starts_ptr,
    partial_ptr,
    rows,
    num_slots,
    IN,
    K,
    stride_x,
    stride_a_slot,
    stride_a_k,
    split_in,  # input columns per split, a multiple of BLOCK_IN: an argument, so no size compiles a kernel again
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    SLOTS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    split = tl.program_id(1)
    slot, token, m_mask, empty = _live_block(
        sorted_rows_ptr, group_starts_ptr, tl.program_id(0), num_slots, rows, BLOCK_M, SLOTS
    )
    if empty:
        return
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    x_rows = x_ptr + token[:, None] * stride_x
    a_cols = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_k[None, :].to(tl.int64) * stride_a_k
    start = split * split_in
    acc = _shrink(x_rows, a_cols, m_mask, k_mask, start, start + split_in, IN, BLOCK_M, BLOCK_K, BLOCK_IN, IEEE_FP32)
    partial = partial_ptr + (split * rows + token[:, None]) * K + offs_k[None, :]
    tl.store(partial, acc, mask=m_mask[:, None] & k_mask[None, :])


@triton.jit(
    do_not_specialize=["rows", "OUT", "K", "num_splits", "stride_partial_split", "stride_partial_row", "stride_out"]
)
def lora_expand_kernel(
    out_ptr,
    partial_ptr,
    b_ptr,
    sorted_rows_ptr,
    group_starts_ptr,
    rows,
    num_slots,
    OUT,
    K,
    num_splits,
    stride_partial_split,
    stride_partial_row,
    stride_partial_slot,  # 0: one slot's K columns per row (the shrink's); K: every slot's (A folded)
    stride_out,
    stride_out_n,
    stride_b_slot,
    stride_b_k,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    SLOTS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    out_block = tl.program_id(1)
    slot, token, m_mask, empty = _live_block(
        sorted_rows_ptr, group_starts_ptr, tl.program_id(0), num_slots, rows, BLOCK_M, SLOTS
    )
    if empty:
        return
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    slot_columns = slot.to(tl.int64) * stride_partial_slot
    partial = partial_ptr + token[:, None] * stride_partial_row + slot_columns + offs_k[None, :]
    pk_mask = m_mask[:, None] & k_mask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for split in range(num_splits):
        acc += tl.load(partial + split * stride_partial_split, mask=pk_mask, other=0.0).to(tl.float32)
    b_rows = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_k[:, None].to(tl.int64) * stride_b_k
    offs_n = out_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    # Rounded once to B's dtype, as a torch bf16 matmul rounds its low-rank product, then a tensor-core dot.
    low_rank = acc.to(b_ptr.dtype.element_ty)
    _add_expand(out_ptr, stride_out, stride_out_n, token, m_mask, low_rank, b_rows, k_mask, offs_n, OUT, IEEE_FP32)
