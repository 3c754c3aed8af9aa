"""The fused MoE Triton kernels (backends.cuda.triton_moe) against the torch reference
(engine.layers.moe.moe_experts).

Without a GPU they run in Triton's CPU interpreter in float32 over small
shapes, sizes that are not powers of two included (a partial tile in N and in
K), both block heights (16: decode, 64: prefill), experts that no token picks
and every token on one expert. On a GPU they run compiled in bf16 over model
sized shapes, with no host sync, and replayed from a CUDA graph under a
routing that changed since the capture.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from triton_interpreter import interpreter_mode

from backends.cuda.triton_moe import MoeTile, fused_moe, max_sorted_blocks, moe_align_block_size
from engine.layers.moe import moe_experts

# CUDA or ROCm: HIP devices are torch "cuda" devices, and Triton compiles the kernels for both.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def kernel_mode():
    return nullcontext() if ON_GPU else interpreter_mode()


def moe_case(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    seed: int = 0,
    routing: str = "random",
) -> tuple[torch.Tensor, ...]:
    """(hidden, gate_up, down, expert_ids, weights) on DEVICE; outputs of order 1.

    routing: "random" (softmax top-k of random logits), "one" (every token on the same experts),
    "sparse" (only experts 0 and E - 1 are ever picked: the others get no token)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=generator)
    if routing == "one":
        logits[:, 1 : 1 + top_k] += 100.0
    elif routing == "sparse":
        logits[:, 0] += 50.0
        logits[:, -1] += 50.0 + torch.randn(tokens, generator=generator)
        assert top_k <= 2
    weights, expert_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    to = {"device": DEVICE, "dtype": dtype}
    return x.to(**to), gate_up.to(**to), down.to(**to), expert_ids.to(DEVICE), weights.to(**to)


def reference(case: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """moe_experts in float32 (for bf16 inputs: the error of the kernel alone, not of the reference)."""
    x, gate_up, down, expert_ids, weights = case
    return moe_experts(x.float(), gate_up.float(), down.float(), expert_ids, weights.float())


def tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


# (tokens, experts, top_k): every combination; hidden/intermediate sizes and the block height
# vary across them so that each of 32/64 x 32/48 and BLOCK_M 16/64 meets several routings.
CPU_SHAPES = [(t, e, k) for t in (1, 3, 17, 40) for e in (4, 8) for k in (1, 2)]
CPU_SIZES = [(32, 32), (64, 48), (32, 48), (64, 32)]
CPU_CASES = [(t, e, k, *CPU_SIZES[i % 4], (16, 64)[(i // 4) % 2]) for i, (t, e, k) in enumerate(CPU_SHAPES)]
CPU_CASES += [(t, e, k, h, i, 80 - bm) for (t, e, k, h, i, bm) in CPU_CASES[::3]]  # the other BLOCK_M too
CPU_CASES += [(17, 8, 2, 48, 40, 16), (40, 4, 2, 80, 40, 64)]  # hidden sizes with a partial tile too


def cpu_tile(block_m: int) -> MoeTile:
    return MoeTile(block_m, 32, 32, num_stages=1)


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,block_m", CPU_CASES)
def test_fused_moe_matches_reference(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, block_m: int
) -> None:
    dtype = torch.float32
    case = moe_case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens * 10 + experts + top_k)
    with kernel_mode():
        got = fused_moe(*case, tile=cpu_tile(block_m) if not ON_GPU else None)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.float().cpu(), reference(case).cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("routing", ["one", "sparse"])
@pytest.mark.parametrize("tokens,top_k,block_m", [(1, 1, 16), (16, 1, 16), (17, 2, 16), (40, 2, 64), (33, 1, 64)])
def test_fused_moe_skewed_routing(routing: str, tokens: int, top_k: int, block_m: int) -> None:
    """Every token on the same experts (a group of exactly one block, 16 tokens at BLOCK_M 16, and
    groups just past one), or only the first and the last expert used (empty experts between)."""
    dtype = torch.float32
    case = moe_case(tokens, 8, top_k, 64, 48, dtype, seed=tokens, routing=routing)
    with kernel_mode():
        got = fused_moe(*case, tile=cpu_tile(block_m) if not ON_GPU else None)
    torch.testing.assert_close(got.float().cpu(), reference(case).cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter", [(1, 8, 2, 48, 40), (3, 4, 1, 32, 48), (17, 8, 2, 64, 32), (5, 16, 4, 80, 48)]
)
def test_fused_moe_per_slot_matches_reference(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> None:
    """The few-token kernels (one program per token slot, no sorting), with partial tiles in N and K."""
    dtype = torch.float32
    case = moe_case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens + experts)
    tile = (
        MoeTile(1, 32, 32, num_stages=1, per_slot=True)
        if not ON_GPU
        else MoeTile(1, 32, 128, num_stages=2, per_slot=True)
    )
    with kernel_mode():
        got = fused_moe(*case, tile=tile)
    assert got.shape == (tokens, hidden)
    torch.testing.assert_close(got.float().cpu(), reference(case).cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


def test_fused_moe_default_tile_int32_ids_and_no_tokens() -> None:
    """The wrapper's own tile choice, int32 expert ids, and an empty batch (no launch)."""
    dtype = torch.float32
    x, gate_up, down, expert_ids, weights = moe_case(24, 4, 2, 32, 48, dtype, seed=3)
    with kernel_mode():
        got = fused_moe(x, gate_up, down, expert_ids.to(torch.int32), weights)
        empty = fused_moe(x[:0], gate_up, down, expert_ids[:0], weights[:0])
    want = reference((x, gate_up, down, expert_ids, weights))
    torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))
    assert empty.shape == (0, 32)


def check_alignment(expert_ids: torch.Tensor, num_experts: int, block_m: int, use_triton: bool = False) -> None:
    with kernel_mode() if use_triton else nullcontext():
        sorted_ids, block_experts, num_valid = moe_align_block_size(expert_ids, num_experts, block_m, use_triton)
    sorted_ids, block_experts, num_valid = sorted_ids.cpu(), block_experts.cpu(), num_valid.cpu()
    flat = expert_ids.flatten().cpu().long()
    slots = flat.shape[0]
    max_blocks = max_sorted_blocks(slots, num_experts, block_m)
    # Shapes depend only on (T, k, E, BLOCK_M); the bound is the one of the design, tightened to the
    # experts that can be hit at all.
    assert sorted_ids.shape == (max_blocks * block_m,) and block_experts.shape == (max_blocks,)
    assert max_blocks <= -(-(slots + num_experts * (block_m - 1)) // block_m)
    assert num_valid.shape == (1,) and sorted_ids.dtype == block_experts.dtype == num_valid.dtype == torch.int32
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    valid_blocks = int(num_valid.item())
    assert valid_blocks * block_m == int(padded.sum()) and valid_blocks <= max_blocks
    # Every slot exactly once, and nothing but padding past the valid blocks.
    real = sorted_ids[sorted_ids < slots].long()
    assert sorted(real.tolist()) == list(range(slots))
    assert bool((sorted_ids[valid_blocks * block_m :] == slots).all())
    assert bool((sorted_ids[sorted_ids >= slots] == slots).all())
    # Each block holds slots of its expert only, in token order, groups in expert order, then padding.
    start = 0
    for expert in range(num_experts):
        blocks = int(padded[expert]) // block_m
        group = sorted_ids[start : start + blocks * block_m]
        assert bool((block_experts[start // block_m : start // block_m + blocks] == expert).all())
        members = group[: int(counts[expert])].long()
        assert bool((flat[members] == expert).all()) and members.tolist() == sorted(members.tolist())
        assert bool((group[int(counts[expert]) :] == slots).all())
        start += blocks * block_m
    assert bool((block_experts[valid_blocks:] == num_experts).all())


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_block_size(block_m: int, use_triton: bool) -> None:
    """Both builders of the sorted order (torch ops; the two Triton launches, in the interpreter
    without a GPU), over routings with up to 300 x 8 slots (several placing programs)."""
    generator = torch.Generator().manual_seed(block_m)
    for tokens, experts, top_k in ((1, 4, 1), (1, 64, 8), (17, 8, 2), (40, 4, 2), (300, 64, 8), (33, 60, 6)):
        scores = torch.rand(tokens, experts, generator=generator)
        check_alignment(torch.topk(scores, top_k, dim=-1).indices.to(DEVICE), experts, block_m, use_triton)
    check_alignment(torch.full((50, 1), 3, device=DEVICE), 8, block_m, use_triton)  # one expert only
    check_alignment(torch.tensor([[0, 7]] * 16, device=DEVICE), 8, block_m, use_triton)  # the first and the last
    check_alignment(torch.tensor([[5, 2]] * 16, device=DEVICE, dtype=torch.int32), 8, block_m, use_triton)  # int32 ids


# ---------------------------------------------------------------------------------------------
# Compiled, on a GPU
# ---------------------------------------------------------------------------------------------

GPU_MATRIX = [(t, e, k) for t in (1, 7, 64, 200, 512) for e, k in ((8, 2), (64, 8))]


@pytest.mark.cuda  # bf16 at model sizes runs compiled on a GPU
@pytest.mark.rocm
@pytest.mark.parametrize("tokens,experts,top_k", GPU_MATRIX)
@pytest.mark.parametrize("hidden,inter", [(1024, 768), (2048, 352)])
def test_fused_moe_bf16_gpu(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> None:
    dtype = torch.bfloat16
    case = moe_case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens + experts)
    got = fused_moe(*case)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), reference(case), atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.cuda  # compiled on a GPU
@pytest.mark.rocm
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [3, 300])
def test_fused_moe_other_dtypes_gpu(dtype: torch.dtype, tokens: int) -> None:
    case = moe_case(tokens, 16, 4, 512, 384, dtype, seed=tokens)
    got = fused_moe(*case)
    tol = 1e-4 if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(got.float(), reference(case), atol=tol, rtol=tol)


@pytest.mark.cuda  # host syncs only exist with a GPU
@pytest.mark.rocm
@pytest.mark.parametrize("tokens", [1, 256])
def test_fused_moe_makes_no_host_sync(tokens: int) -> None:
    case = moe_case(tokens, 64, 8, 512, 256, torch.bfloat16, seed=1)
    fused_moe(*case)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_moe(*case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.float(), reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda  # captured in a device graph: CUDA, or HIP on ROCm
@pytest.mark.rocm
@pytest.mark.parametrize("tokens", [4, 128])
def test_fused_moe_replays_from_a_cuda_graph(tokens: int) -> None:
    """Captured once, replayed with other tokens and another routing (every token on one expert
    after a random one): the graph holds no trace of the routing it was captured with."""
    dtype = torch.bfloat16
    first = moe_case(tokens, 64, 8, 512, 256, dtype, seed=5)
    x, gate_up, down, expert_ids, weights = (t.clone() for t in first)
    fused_moe(x, gate_up, down, expert_ids, weights)  # compile before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, expert_ids, weights)
    for seed, routing in ((6, "random"), (7, "one")):
        other = moe_case(tokens, 64, 8, 512, 256, dtype, seed=seed, routing=routing)
        x.copy_(other[0])
        expert_ids.copy_(other[3])
        weights.copy_(other[4])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.float(), reference((x, gate_up, down, expert_ids, weights)), atol=2e-2, rtol=2e-2
        )


@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize", [(1, 8, 2, True), (5, 60, 6, True), (9, 128, 8, False), (3, 4, 1, False)]
)
def test_route_kernel_matches_softmax_top_k(tokens: int, experts: int, top_k: int, renormalize: bool) -> None:
    """The one-launch routing against torch's softmax + top-k (+ renormalising): the same experts per
    token (as sets: the order of equal weights is free) and the same weights in the same order."""
    from backends.cuda.triton_moe import moe_route
    from engine.layers.moe import softmax_top_k

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(DEVICE, torch.bfloat16)
    with kernel_mode():
        ids, weights = moe_route(logits, top_k, renormalize)
    want_ids, want_weights = softmax_top_k(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (tokens, top_k)
    # bf16 logits tie often: the same set of experts per token, the weights in the same descending order.
    assert torch.equal(ids.long().cpu().sort(dim=-1).values, want_ids.cpu().sort(dim=-1).values)
    torch.testing.assert_close(weights.cpu(), want_weights.cpu(), atol=1e-6, rtol=1e-5)


def test_route_kernel_ties_take_the_lower_expert() -> None:
    from backends.cuda.triton_moe import moe_route

    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]], device=DEVICE)
    with kernel_mode():
        ids, weights = moe_route(logits, 2, True)
    assert ids.cpu().tolist() == [[1, 3]]
    torch.testing.assert_close(weights.cpu(), torch.tensor([[0.5, 0.5]]))


def test_tile_choice_follows_the_h200_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_tile off the interpreter (the compiled kernels' tiles): per slot up to one slot per expert on
    average, 8 columns a program up to 8 slots, grouped BLOCK_M 16 to 16 slots per expert, 64 beyond:
    the choices benchmarks/moe_kernel.py --sweep measured best (docs/cuda.md, session (d))."""
    import backends.cuda.triton_moe as triton_moe

    monkeypatch.setattr(triton_moe, "interpreted", lambda: False)
    bf16 = torch.bfloat16
    qwen3 = {t: triton_moe.moe_tile(t, 8, 128, bf16) for t in (1, 4, 16, 17, 32, 128, 512)}
    assert qwen3[1] == MoeTile(1, 8, 128, num_warps=8, num_stages=2, per_slot=True)  # 8 slots
    assert qwen3[4] == qwen3[16] == MoeTile(1, 32, 128, num_warps=8, num_stages=2, per_slot=True)
    assert not qwen3[17].per_slot and qwen3[32].block_m == qwen3[128].block_m == 16  # > 1 slot per expert
    assert qwen3[512].block_m == 64  # 32 slots per expert
    mixtral = {t: triton_moe.moe_tile(t, 2, 8, bf16) for t in (1, 4, 5, 64, 65)}
    assert mixtral[1].per_slot and mixtral[1].block_n == 8 and mixtral[4].per_slot and mixtral[4].block_n == 8
    assert mixtral[5].block_m == 16 and mixtral[64].block_m == 16 and mixtral[65].block_m == 64
