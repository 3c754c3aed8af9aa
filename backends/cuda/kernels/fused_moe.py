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
    hidden_ptr,
    w_ptr,
    out_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    num_slots,
    hidden_size,
    inter_size,
    stride_ht,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_on,
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
    act_ptr,
    w_ptr,
    out_ptr,
    routing_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    num_slots,
    hidden_size,
    inter_size,
    stride_at,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_os,
    stride_on,
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


# ---------------------------------------------------------------------------------------------
# Few tokens (decode): one program per token slot, no sorting.
#
# At a handful of slots per expert the grouped GEMM pads each expert's rows to 16 (15 of 16 rows
# wasted at batch 1) and needs the sorted order first (a dozen small torch launches per layer, each
# a few microseconds inside a graph, as long as the layer's weight reads). These kernels take the
# expert of a slot straight from the routing and multiply its weights by one row with CUDA-core
# dot products (tl.sum over a [BLOCK_N, BLOCK_K] tile), which is what a step bound by weight bytes
# needs. Grid axis 0 is the slot and axis 1 the weight tile, slots first: the slots that picked the
# same expert run side by side on the same tile, so only the first of them reads it from memory.
# ---------------------------------------------------------------------------------------------


@triton.jit
def moe_slot_gate_up_kernel(
    hidden_ptr,
    w_ptr,
    out_ptr,
    expert_ids_ptr,
    hidden_size,
    inter_size,
    stride_ht,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_os,
    stride_on,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[slot, n] = silu(hidden[token] . gate[e, n]) * (hidden[token] . up[e, n]), e = expert_ids[slot].

    expert_ids is the flattened [T, k] routing (slot = token * k + choice); w is gate_up [E, 2I, H];
    out [slots, I]. Accumulates in float32."""
    slot = tl.program_id(0)
    n_tile = tl.program_id(1)
    token = (slot // TOP_K).to(tl.int64)
    expert = tl.load(expert_ids_ptr + slot).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + token * stride_ht + offs_k * stride_hk
    gate_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    up_ptrs = gate_ptrs + inter_size * stride_wn
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_mask = offs_k < hidden_size - k0
        a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(gate * a[None, :], axis=1)
        acc_up += tl.sum(up * a[None, :], axis=1)
        a_ptrs += BLOCK_K * stride_hk
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(out_ptr + slot * stride_os + offs_n * stride_on, act.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def moe_slot_down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    routing_ptr,
    expert_ids_ptr,
    hidden_size,
    inter_size,
    stride_as,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_os,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[slot, n] = routing[slot] * (act[slot] . down[e, n]), e = expert_ids[slot]; w is down
    [E, H, I], act [slots, I] (moe_slot_gate_up_kernel's output), out [slots, H]."""
    slot = tl.program_id(0)
    n_tile = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + slot).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + slot.to(tl.int64) * stride_as + offs_k * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_mask = offs_k < inter_size - k0
        a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    acc = acc * tl.load(routing_ptr + slot).to(tl.float32)
    tl.store(
        out_ptr + slot.to(tl.int64) * stride_os + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=n_mask
    )


@triton.jit
def moe_route_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    num_experts,
    stride_lt,
    stride_le,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
):
    """One token's routing: softmax over its router logits in float32, the top k (k arg-max passes,
    the lowest expert id first among equal probabilities), renormalised to sum to one where the
    config asks. ids [T, k] int32, weights [T, k] float32. Replaces torch's softmax, its two top-k
    kernels and the renormalising division: four launches per layer, each longer than this one."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs * stride_le, mask=valid, other=-float("inf")).to(tl.float32)
    numerators = tl.exp(logits - tl.max(logits, axis=0))
    probs = numerators / tl.sum(numerators, axis=0)
    remaining = tl.where(valid, probs, -1.0)
    choices = tl.arange(0, BLOCK_TOP_K)
    chosen_ids = tl.zeros([BLOCK_TOP_K], dtype=tl.int32)
    chosen_weights = tl.zeros([BLOCK_TOP_K], dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        # The lowest index holding the maximum (tl.argmax's tie rule is not documented).
        expert = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        chosen_ids = tl.where(choices == choice, expert, chosen_ids)
        chosen_weights = tl.where(choices == choice, best, chosen_weights)
        remaining = tl.where(offs == expert, -1.0, remaining)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)  # unused lanes hold 0
    keep = choices < TOP_K
    tl.store(ids_ptr + token * TOP_K + choices, chosen_ids, mask=keep)
    tl.store(weights_ptr + token * TOP_K + choices, chosen_weights, mask=keep)


# ---------------------------------------------------------------------------------------------
# The sorted order of the slots (moe_align_block_size) in two launches instead of a dozen torch ops
# (a radix sort alone took 27 us per layer at 256 slots on the H200). The result is the torch
# version's exactly: groups in expert order, slots in token order within a group.
# ---------------------------------------------------------------------------------------------


@triton.jit
def moe_align_groups_kernel(
    ids_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    group_start_ptr,
    num_slots,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EXPERT_BINS: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: each expert's slot count, its group padded to whole BLOCK_M blocks, where each
    group starts (group_start [E], for moe_place_slots_kernel), the expert of every block (E past the
    valid ones), the number of valid blocks, and every position of sorted_slots set to the padding id
    num_slots (the slots are placed over it next)."""
    offs = tl.arange(0, BLOCK_S)
    # Past num_slots: the id num_experts, a bin of its own (EXPERT_BINS > num_experts), then zeroed.
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=num_experts).to(tl.int32)
    bins = tl.arange(0, EXPERT_BINS)
    counts = tl.where(bins < num_experts, tl.histogram(ids, EXPERT_BINS), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(group_start_ptr + bins, padded_end - padded, mask=bins < num_experts)
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    # Block b's expert: how many groups end at or before its first row (searchsorted, right side).
    blocks = tl.arange(0, BLOCKS_PAD)
    ended = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & (bins < num_experts)[None, :]
    tl.store(block_experts_ptr + blocks, tl.sum(ended.to(tl.int32), axis=1), mask=blocks < max_blocks)
    for start in range(0, max_blocks * BLOCK_M, FILL):
        fill = start + tl.arange(0, FILL)
        tl.store(
            sorted_slots_ptr + fill, tl.zeros([FILL], dtype=tl.int32) + num_slots, mask=fill < max_blocks * BLOCK_M
        )


@triton.jit(do_not_specialize=["num_slots"])
def moe_place_slots_kernel(
    ids_ptr,
    sorted_slots_ptr,
    group_start_ptr,
    num_slots,
    BLOCK: tl.constexpr,
    OTHERS: tl.constexpr,
):
    """Each slot to its group's start plus the number of earlier slots of the same expert (its rank in
    token order): deterministic, no atomics. Program p ranks its BLOCK slots against the slots before
    them, OTHERS at a time (the last program's work grows with every slot before it)."""
    pid = tl.program_id(0)
    slots = pid * BLOCK + tl.arange(0, BLOCK)
    valid = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=valid, other=-1).to(tl.int32)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, (pid + 1) * BLOCK, OTHERS):
        others = start + tl.arange(0, OTHERS)
        other_ids = tl.load(ids_ptr + others, mask=others < num_slots, other=-2).to(tl.int32)
        earlier = (other_ids[None, :] == ids[:, None]) & (others[None, :] < slots[:, None])
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.load(group_start_ptr + ids, mask=valid, other=0)
    tl.store(sorted_slots_ptr + start + rank, slots.to(tl.int32), mask=valid)
