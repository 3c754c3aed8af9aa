"""Fused mixture-of-experts in Triton (CUDA and ROCm), safe to capture in a graph.

The same semantics and dtypes as `engine.layers.moe.moe_experts` (the torch
reference, which loops over the experts that were hit and so looks at the
routing on the host), as a grouped GEMM over the token slots sorted by expert,
the design of vLLM's and SGLang's fused_moe:

1. `moe_align_block_size`: the T x k slots (slot = token * k + choice) sorted
   by expert, each expert's group padded to a multiple of BLOCK_M with an
   invalid slot id (T * k), the expert of every BLOCK_M rows, and the number
   of valid blocks, all on the device in torch ops of fixed shapes.
2. `moe_gate_up_kernel`: per block of one expert's rows, the token rows of
   `hidden` gathered and multiplied by that expert's gate and up, SiLU(gate) *
   up in the epilogue -> [padded rows, I].
3. `moe_down_kernel`: those rows by the expert's down, times the routing
   weight, written per slot -> [T, k, H].
4. the sum over each token's k slots (torch's sum, or the compiled step's:
   deterministic, no atomics).

With few slots per expert (decode) the tile is `per_slot`: no sorting at all,
one program per token slot and weight tile reading the slot's expert from the
routing (`moe_slot_gate_up_kernel`, `moe_slot_down_kernel`): two launches
instead of a dozen, and no rows padded to 16. Up to TRITON_ALIGN_MAX_SLOTS
slots, step 1 is two Triton launches rather than torch ops. The routing itself
(softmax, top k, renormalisation) is one launch too (`moe_route`).

No step reads a device value on the host, and every shape and grid depends
only on (T, k, E, BLOCK_M) and the weights' shapes: a launch is capturable in
a CUDA graph keyed by the token count, whatever the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.cuda.triton_build import interpreted, load_kernel
from backends.hip.triton_hints import triton_launch_options

KERNELS = "backends.cuda.kernels.fused_moe"

# Up to this many token slots per expert on average, moe_tile picks the per-slot kernels. On the H200
# (benchmarks/moe_kernel.py --sweep, 2026-12-02, ms per layer): Qwen3-30B-A3B's experts at 1 slot per
# expert (16 tokens) 0.220 per slot against 0.235 grouped, at 2 (32 tokens) 0.479 against 0.329;
# Mixtral-8x7B's at 1 (4 tokens) 0.546 against 0.540.
PER_SLOT_MAX_SLOTS_PER_EXPERT = 1.0


@dataclass(frozen=True)
class MoeTile:
    """Block sizes of the two grouped GEMMs. block_m rows of one expert per program; block_n output
    columns (the gate/up kernel keeps a gate and an up accumulator of that width); block_k the
    reduction step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    per_slot: bool = False  # one program per token slot (block_m unused): the few-token kernels


def moe_tile(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeTile:
    """The tile for a step of `num_tokens` tokens: it depends on shapes only, so a graph captured for
    a token count keeps it.

    Decode at a few slots per expert (at most PER_SLOT_MAX_SLOTS_PER_EXPERT on average): per slot, no
    sorting and no padded rows. Beyond that the grouped GEMM: BLOCK_M 16 (the smallest tl.dot takes)
    while an expert averages at most 16 slots, so the weights are streamed once per expert hit;
    prefill: BLOCK_M 64, each weight tile reused across 64 rows."""
    slots_per_expert = num_tokens * top_k / max(num_experts, 1)
    if interpreted():
        # The CPU interpreter: 32-wide tiles, so the tests' non-power-of-2 sizes (48) cut a partial
        # tile in N and in K, and both BLOCK_M paths run.
        return MoeTile(16 if slots_per_expert <= 16 else 64, 32, 32, num_warps=4, num_stages=1)
    wide = dtype == torch.float32  # float32 tiles take twice the registers and shared memory
    if slots_per_expert <= PER_SLOT_MAX_SLOTS_PER_EXPERT:
        # Up to 8 slots, 8 columns per program so that a batch-1 step still starts ~800 programs
        # (Qwen3-MoE 0.029 ms against 0.042 with 32 columns; Mixtral 0.182 against 0.264).
        return MoeTile(1, 8 if num_tokens * top_k <= 8 else 32, 128, num_warps=8, num_stages=2, per_slot=True)
    if slots_per_expert <= 16:
        return MoeTile(16, 64 if not wide else 32, 128 if not wide else 64, num_warps=4, num_stages=3)
    return MoeTile(64, 64, 64 if not wide else 32, num_warps=4, num_stages=3)


def max_sorted_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the BLOCK_M blocks of the padded sorted slots, over every routing: each
    expert that is hit (at most min(E, slots) of them) pads its group by fewer than BLOCK_M rows."""
    if num_slots == 0:
        return 0
    return -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)


# Up to this many slots the sorted order is built by two Triton launches (one program holds every
# slot's expert id); beyond, by torch ops, whose dozen launches a prefill step's GEMMs dwarf.
TRITON_ALIGN_MAX_SLOTS = 4096


def moe_align_block_size(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of expert_ids [T, k] sorted by expert, each expert's group padded to whole blocks.

    Returns (sorted_slot_ids [max_blocks * block_m] int32: slot = token * k + choice, padding = T * k;
    block_experts [max_blocks] int32: the expert of each block, num_experts past the valid ones;
    num_valid_blocks [1] int32), max_blocks = max_sorted_blocks(T * k, E, block_m). Within an
    expert the slots keep their order (a stable sort). No host sync, capturable in a CUDA graph.
    use_triton: the two-launch kernels (default: on a GPU, up to TRITON_ALIGN_MAX_SLOTS slots), else
    torch ops of fixed shapes; both give the same result."""
    num_slots = expert_ids.numel()
    if use_triton is None:
        use_triton = expert_ids.is_cuda and num_slots <= TRITON_ALIGN_MAX_SLOTS
    if use_triton and num_slots > 0:
        return _align_triton(expert_ids, num_experts, block_m)
    return _align_torch(expert_ids, num_experts, block_m)


def _align_triton(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import triton

    device = expert_ids.device
    flat = expert_ids.reshape(-1)
    num_slots = flat.shape[0]
    max_blocks = max_sorted_blocks(num_slots, num_experts, block_m)
    sorted_slot_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_valid_blocks = torch.empty(1, dtype=torch.int32, device=device)
    group_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    load_kernel(KERNELS, "moe_align_groups_kernel")[(1,)](
        flat,
        sorted_slot_ids,
        block_experts,
        num_valid_blocks,
        group_start,
        num_slots,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_S=triton.next_power_of_2(num_slots),
        EXPERT_BINS=triton.next_power_of_2(num_experts + 1),
        BLOCKS_PAD=triton.next_power_of_2(max_blocks),
        FILL=1024,
        num_warps=4,
    )
    # 128 slots per program, as measured on the H200 (2026-12-02: 25 us a layer at 1,024 slots, the last
    # program ranking its slots against all before it); smaller blocks would shorten it, not yet measured.
    place_block = 128
    load_kernel(KERNELS, "moe_place_slots_kernel")[(triton.cdiv(num_slots, place_block),)](
        flat,
        sorted_slot_ids,
        group_start,
        num_slots,
        BLOCK=place_block,
        OTHERS=128,
        num_warps=4,
    )
    return sorted_slot_ids, block_experts, num_valid_blocks


def _align_torch(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Torch ops of fixed shapes only. (bincount is not used: its output size depends on the largest
    # id, which torch reads on the host.)
    device = expert_ids.device
    flat = expert_ids.reshape(-1).to(torch.int64)
    num_slots = flat.shape[0]
    max_blocks = max_sorted_blocks(num_slots, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # where each expert's padded group ends
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts  # where each expert's slots start, unpadded
    sorted_experts, order = torch.sort(flat, stable=True)
    # Sorted position i of expert e is its (i - count_start[e])-th slot: it goes there past e's padded start.
    rank = torch.arange(num_slots, device=device) - count_start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_slot_ids = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_slot_ids.scatter_(0, dest, order.to(torch.int32))
    # Block b's rows start at b * block_m: its expert is the first whose padded group ends after that.
    block_starts = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True, out_int32=True)
    num_valid_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    return sorted_slot_ids, block_experts, num_valid_blocks


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tile: MoeTile | None = None,
    sum_slots: bool = True,
) -> torch.Tensor:
    """The experts' outputs, weighted and summed over each token's top k: [T, H] in hidden's dtype
    ([T, k, H], each slot's weighted output, with sum_slots=False: the caller sums, e.g. in a compiled
    step where the sum joins the next kernel).

    hidden [T, H]; gate_up [E, 2I, H] (gate rows [0, I), up rows [I, 2I), as nn.Linear weights);
    down [E, H, I]; expert_ids [T, k] (any integer dtype); weights [T, k] routing weights (any float
    dtype; applied in float32). hidden and the expert weights share a dtype: bfloat16, float16 or
    float32. tile: block sizes, default moe_tile() for this T. No host sync: capturable in a CUDA graph."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter_size = down.shape[0], down.shape[2]
    top_k = expert_ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter_size, hidden_size), (gate_up.shape, down.shape, hidden.shape)
    assert down.shape[1] == hidden_size and weights.shape == expert_ids.shape
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden) if sum_slots else hidden.new_zeros(num_tokens, top_k, hidden_size)
    if tile is None:
        tile = moe_tile(num_tokens, top_k, num_experts, hidden.dtype)
    if tile.per_slot:
        per_slot = _moe_per_slot(hidden, gate_up, down, expert_ids, weights, tile)
    else:
        per_slot = _moe_grouped(hidden, gate_up, down, expert_ids, weights, tile)
    # The k slots of a token are rows token * k ... token * k + k - 1.
    per_slot = per_slot.view(num_tokens, top_k, hidden_size)
    if not sum_slots:
        return per_slot
    return per_slot.squeeze(1) if top_k == 1 else per_slot.sum(dim=1)  # float32 accumulation inside torch


def _moe_grouped(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tile: MoeTile,
) -> torch.Tensor:
    """Each slot's weighted output [T * k, H] by the grouped GEMMs over the slots sorted by expert."""
    import triton

    gate_up_kernel, down_kernel = load_kernel(KERNELS, "moe_gate_up_kernel"), load_kernel(KERNELS, "moe_down_kernel")
    num_tokens, hidden_size = hidden.shape
    num_experts, inter_size = down.shape[0], down.shape[2]
    top_k = expert_ids.shape[1]
    num_slots = num_tokens * top_k
    sorted_slot_ids, block_experts, num_valid_blocks = moe_align_block_size(expert_ids, num_experts, tile.block_m)
    max_blocks = block_experts.shape[0]
    ieee = hidden.dtype == torch.float32 and not interpreted()
    # SiLU(gate) * up per sorted row (padding rows included, as zeros), in the hidden dtype like the
    # reference's intermediate.
    act = torch.empty(max_blocks * tile.block_m, inter_size, dtype=hidden.dtype, device=hidden.device)
    gate_up_kernel[(max_blocks, triton.cdiv(inter_size, tile.block_n))](
        hidden,
        gate_up,
        act,
        sorted_slot_ids,
        block_experts,
        num_valid_blocks,
        num_slots,
        hidden_size,
        inter_size,
        hidden.stride(0),
        hidden.stride(1),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up.stride(2),
        act.stride(0),
        act.stride(1),
        TOP_K=top_k,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        IEEE_FP32=ieee,
        **triton_launch_options(
            "moe", tile.num_warps, tile.num_stages, tile_mn=(tile.block_m, tile.block_n), block_k=tile.block_k
        ),
    )
    routing = weights.reshape(-1)  # slot order: token * k + choice
    per_slot = torch.empty(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down_kernel[(max_blocks, triton.cdiv(hidden_size, tile.block_n))](
        act,
        down,
        per_slot,
        routing,
        sorted_slot_ids,
        block_experts,
        num_valid_blocks,
        num_slots,
        hidden_size,
        inter_size,
        act.stride(0),
        act.stride(1),
        down.stride(0),
        down.stride(1),
        down.stride(2),
        per_slot.stride(0),
        per_slot.stride(1),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        IEEE_FP32=ieee,
        **triton_launch_options(
            "moe", tile.num_warps, tile.num_stages, tile_mn=(tile.block_m, tile.block_n), block_k=tile.block_k
        ),
    )
    return per_slot


def _moe_per_slot(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tile: MoeTile,
) -> torch.Tensor:
    """Each slot's weighted output [T * k, H] by a gate/up launch and a down launch over (slot, weight tile)."""
    import triton

    gate_up_kernel = load_kernel(KERNELS, "moe_slot_gate_up_kernel")
    down_kernel = load_kernel(KERNELS, "moe_slot_down_kernel")
    num_tokens, hidden_size = hidden.shape
    inter_size, top_k = down.shape[2], expert_ids.shape[1]
    num_slots = num_tokens * top_k
    flat_ids = expert_ids.reshape(-1)
    options = triton_launch_options("moe", tile.num_warps, tile.num_stages)  # no tl.dot: no MFMA options
    act = torch.empty(num_slots, inter_size, dtype=hidden.dtype, device=hidden.device)
    gate_up_kernel[(num_slots, triton.cdiv(inter_size, tile.block_n))](
        hidden,
        gate_up,
        act,
        flat_ids,
        hidden_size,
        inter_size,
        hidden.stride(0),
        hidden.stride(1),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up.stride(2),
        act.stride(0),
        act.stride(1),
        TOP_K=top_k,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        **options,
    )
    per_slot = torch.empty(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down_kernel[(num_slots, triton.cdiv(hidden_size, tile.block_n))](
        act,
        down,
        per_slot,
        weights.reshape(-1),
        flat_ids,
        hidden_size,
        inter_size,
        act.stride(0),
        act.stride(1),
        down.stride(0),
        down.stride(1),
        down.stride(2),
        per_slot.stride(0),
        per_slot.stride(1),
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        **options,
    )
    return per_slot


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.layers.moe.softmax_top_k in one launch: (expert ids [T, k] int32, weights [T, k] float32).
    Among equal probabilities the lower expert id is chosen first. No host sync: capturable."""
    import triton

    num_tokens, num_experts = logits.shape
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    load_kernel(KERNELS, "moe_route_kernel")[(num_tokens,)](
        logits,
        ids,
        weights,
        num_experts,
        logits.stride(0),
        logits.stride(1),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_TOP_K=triton.next_power_of_2(top_k),
        **triton_launch_options("moe", 4 if num_experts <= 256 else 8),
    )
    return ids, weights
