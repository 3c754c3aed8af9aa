"""Ragged paged attention in Triton: a whole batch of variable-length queries in one launch.

Each request brings `q_len` new tokens that attend to its whole context in
the paged KV cache (a cached prefix, then the new tokens themselves, causal
among them); its k/v are already stored. One program covers BLOCK_Q tokens
of one request for one KV head, with the GQA group's query heads packed into
the rows of the same tile (BLOCK_Q x GROUP rows), so each K/V tile is read
once per group rather than once per head.

The grid depends only on the number of tokens and requests in the batch,
never on the lengths themselves: a program finds its request by a binary
search over the query offsets on the device (as vLLM's unified Triton
attention does), and programs past the end of their request return at once.
So a launch is capturable in a CUDA graph keyed by token count.

The context before the first token of a block is visible to every row of it
and runs without a mask; only the last stretch (the block's own tokens)
applies the causal mask.
"""

from __future__ import annotations

import torch

from backends.cuda.triton_build import interpreted, load_kernel
from backends.hip.triton_hints import EXTEND_ROWS_ON_HIP, is_rocm_build, triton_launch_options

KERNELS = "backends.cuda.kernels.ragged_attention"


def check_kv_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, cache_dtype: torch.dtype) -> bool:
    """Whether a launch reads k/v scales: both given (one float32 element each, read by the kernel on
    the device, so a captured graph keeps reading the loaded values), or neither. Only an FP8 cache
    is stored divided by them: scales over a float cache would scale values stored unscaled."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale come together (a cache scaled on one side only is not a format)")
    if k_scale is None:
        return False
    if cache_dtype != torch.float8_e4m3fn:
        raise ValueError(f"KV cache scales apply to an FP8 (e4m3) cache only, not to a {cache_dtype} one")
    for scale in (k_scale, v_scale):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"KV cache scales are float32 scalars, got {scale.dtype} of shape {tuple(scale.shape)}")
    return True


def ragged_tile(head_dim: int, group: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_Q tokens, GROUP_PAD heads, BLOCK_N keys) per program: ~128 query rows for bf16/fp16
    at head_dim <= 128 (64 at 256, or in float32, where registers run out first)."""
    import triton

    group_pad = triton.next_power_of_2(group)
    rows = 128 if head_dim <= 128 and dtype != torch.float32 else 64
    if is_rocm_build():
        rows = min(rows, EXTEND_ROWS_ON_HIP)  # SGLang's HIP extend tile: MI300's register file fits 64 rows
    if interpreted():
        rows = 32  # the CPU interpreter: small tiles run faster and still cover several blocks a request
    block_q = max(1, rows // group_pad)
    if block_q * group_pad < 16:  # tl.dot needs >= 16 rows
        block_q = 16 // group_pad
    block_n = 64 if head_dim <= 128 else 32
    if interpreted():
        block_n = 16
    return block_q, group_pad, block_n


def ragged_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """window: a sliding window (each query sees its last `window` positions); 0 for none.
    softcap: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2); 0 for none.

    q [tokens, H, D] (request i's tokens at query_start_loc[i]:[i+1]), caches [slots, KVH, D] with
    this step's k/v already stored, seq_lens [B] context lengths including the new tokens, page_table
    [B, pages] -> [tokens, H, D]. query_start_loc [B + 1] and seq_lens int32 on the device.
    k_scale, v_scale: float32 scalars on the device for a cache holding k / k_scale and v / v_scale
    (both or neither; None: unit scale)."""
    import triton

    kernel = load_kernel(KERNELS, "ragged_paged_attention_kernel")
    tokens, heads, head_dim = q.shape
    num_requests = seq_lens.shape[0]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    block_q, group_pad, block_n = ragged_tile(head_dim, group, q.dtype)
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    # Enough programs for any split of `tokens` over `num_requests` (each rounds up to one block).
    grid = (tokens // block_q + num_requests, kv_heads)
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        page_table,
        k_scale if scaled else q,
        v_scale if scaled else q,  # unread unless KV_SCALED
        num_requests,
        scale * 1.4426950408889634,  # log2(e): the kernel's softmax runs in exp2
        window,
        softcap,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        WINDOWED=window > 0,
        IEEE_FP32=q.dtype == torch.float32 and not interpreted(),
        SOFTCAPPED=softcap > 0,
        KV_SCALED=scaled,
        **triton_launch_options(
            "extend",
            8 if block_q * group_pad >= 128 else 4,
            2,
            tile_mn=(block_q * group_pad, block_n),
            block_k=min(max(16, triton.next_power_of_2(head_dim)), block_n),
        ),
    )
    return out
