"""Triton source of the fused mixture-of-experts kernels (imported only through backends.cuda.triton_moe).

Both kernels are one grouped GEMM over the token slots sorted by expert
(backends.cuda.triton_moe.moe_align_block_size): rows [b * BLOCK_M, (b + 1) *
BLOCK_M) of the sorted order all belong to one expert, `block_experts[b]`, so
program (b, n) multiplies those rows by one BLOCK_N wide tile of that expert's
weights. Padded rows carry the slot id `num_slots` (one past the last slot):
they load zeros and are never stored. The grid is an upper bound on the
number of blocks that depends only on the shapes; the blocks past
`num_blocks` (a device scalar) return at once, so nothing here needs the
routing on the host and a launch is capturable in a CUDA graph.

Grid axis 0 is the block and axis 1 the weight tile: programs are started
along axis 0 first, so the blocks of one expert that run side by side read
the same weight tile (an L2 hit for all but the first of them).
"""

import triton
import triton.language as tl


# num_slots (tokens x top_k) changes from step to step: not specialised on, or Triton would compile a
# variant per value class (1, a multiple of 16, other) in the middle of serving. The sizes and
# strides are the model's and stay put.
@triton.jit(do_not_specialize=["num_slots"])
def moe_gate_up_kernel(
    hidden_ptr, w_ptr, out_ptr,
    sorted_slots_ptr, block_experts_ptr, num_blocks_ptr,
    num_slots, hidden_size, inter_size,
    stride_ht, stride_hk,
    stride_we, stride_wn, stride_wk,
    stride_ot, stride_on,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """out[row, n] = silu(hidden[token] . gate[e, n]) * (hidden[token] . up[e, n]) for the block's rows.

    w is gate_up [E, 2I, H]: gate rows [0, I), up rows [I, 2I). out [padded rows, I] is indexed by
    the sorted position (not the slot), so the down kernel reads its rows contiguously.

    The activation is fused into this epilogue rather than run as a separate kernel: each program
    keeps a gate and an up accumulator for the same BLOCK_N columns, so the [rows, 2I] product never
    goes to memory (only [rows, I] does), which halves the traffic between the GEMMs and saves a
    launch; the price is a second accumulator's registers, which BLOCK_N is sized for."""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block >= tl.load(num_blocks_ptr):
        return  # past the padded end of the sorted slots: the bound covered the worst routing
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    # A slot is (token, choice) flattened: token = slot // top_k. Padding reads token 0, masked.
    tokens = tl.where(valid, slots // TOP_K, 0).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + tokens[:, None] * stride_ht + offs_k[None, :] * stride_hk
    # [BLOCK_K, BLOCK_N] tiles of gate and up, transposed on the fly (weights are [N, K] row-major).
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + inter_size * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_mask = offs_k < hidden_size - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if IEEE_FP32:
            acc_gate = tl.dot(a, gate, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, up, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
        a_ptrs += BLOCK_K * stride_hk
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    # SiLU in float32 on the accumulators; padded rows give silu(0) * 0 = 0, written like the rest
    # so the down kernel's loads of them need no mask.
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def moe_down_kernel(
    act_ptr, w_ptr, out_ptr, routing_ptr,
    sorted_slots_ptr, block_experts_ptr, num_blocks_ptr,
    num_slots, hidden_size, inter_size,
    stride_at, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_os, stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """out[slot, n] = routing[slot] * (act[row] . down[e, n]) for the block's valid rows.

    act [padded rows, I] by sorted position (moe_gate_up_kernel's output), w is down [E, H, I],
    routing [slots] the flattened [T, k] weights, out [slots, H] (= [T, k, H]), one row per slot:
    every slot is written by exactly one program per tile, so no atomics, and the sum over a
    token's k slots afterwards is deterministic."""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    safe_slots = tl.where(valid, slots, 0).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    # Every row of a valid block was written by the gate/up kernel (padding as zeros): rows unmasked.
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_mask = offs_k < inter_size - k0
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE_FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    routing = tl.load(routing_ptr + safe_slots, mask=valid, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + safe_slots[:, None] * stride_os + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
