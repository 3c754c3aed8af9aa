"""Paged decode attention in Triton (CUDA and ROCm), safe to capture in a graph.

Two kernels, chosen by how many programs the batch gives the GPU:

- one pass, one program per (request, kv head), walking the request's pages
  up to its sequence length with an online softmax over the GQA group of
  query heads. At batch 32 and up this fills the GPU on its own.
- split-K (flash-decoding): at small batch one program per (request, kv
  head) leaves most SMs idle (8 programs at batch 1 on 132 SMs, whatever the
  context), so each (request, kv head) is cut into `splits` ranges of its
  context, each program writes a partial result and its log-sum-exp, and a
  second small kernel combines them. The split count depends only on the
  batch size and the GPU, so one captured graph still serves any context
  length: each program works out its own range from the sequence length on
  the device, and ranges past the end return at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from backends.cuda.triton_build import interpreted, load_kernel
from backends.cuda.triton_extend import check_kv_scales
from backends.hip.triton_hints import triton_launch_options

MAX_SPLITS = 16
# Programs per SM the split count aims for; at or above it the one-pass kernel runs.
PROGRAMS_PER_SM = 2


KERNELS = "backends.cuda.kernels.paged_decode"


@dataclass(frozen=True)
class DecodeTile:
    """Keys a program loads per iteration, and the launch's warps and pipeline stages (None: Triton's)."""

    block_n: int
    num_warps: int = 4
    num_stages: int | None = None


def decode_tile(head_dim: int) -> DecodeTile:
    """The decode kernel's launch tile (benchmarks/attention_sweep.py times the alternatives)."""
    return DecodeTile(block_n=64 if head_dim <= 128 else 32)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """How many context ranges each (request, kv head) is cut into: enough programs for every SM
    (PROGRAMS_PER_SM each), a power of two up to MAX_SPLITS; 1 where the batch fills the GPU."""
    if device.type != "cuda":
        return 1 if batch * kv_heads >= 64 else 4  # the interpreter (CPU tests): both paths, small
    target = PROGRAMS_PER_SM * _multiprocessors(device.index or 0)
    splits = 1
    while splits < MAX_SPLITS and batch * kv_heads * splits < target:
        splits *= 2
    return splits


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    fp8_max: float = 0.0,
    tile: DecodeTile | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D], caches [slots, KVH, D], page_table [B, pages], seq_lens [B] -> [B, H, D].

    splits: context ranges per (request, kv head); default decode_splits() for this batch.
    window: a sliding window (the last `window` positions only); 0 for none.
    softcap: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2); 0 for none.
    new_kv: (k [B, KVH, D], v [B, KVH, D], slot_indices [B]): this step's k/v, stored by the kernel
    itself at each row's last position (None: they are in the cache already). fp8_max: an FP8 cache's
    saturation bound for those stores. tile: the launch's tile (default decode_tile(); the sweep's knob).
    k_scale, v_scale: float32 scalars on the device for a cache holding k / k_scale and v / v_scale (new
    rows stored divided by them); both or neither, None: unit scale."""
    import triton

    decode_kernel, combine_kernel = (
        load_kernel(KERNELS, "paged_decode_kernel"),
        load_kernel(KERNELS, "combine_splits_kernel"),
    )
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if splits is None:
        splits = decode_splits(batch, kv_heads, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"decode splits must be 1..{MAX_SPLITS}, got {splits}")
    out = torch.empty_like(q)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile = tile or decode_tile(head_dim)
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    if splits == 1:
        partial, lse = out.unsqueeze(2), out  # written directly; lse unused
    else:
        # Sized for MAX_SPLITS whatever the count, so that the strides (which Triton specialises on) are
        # the same for every split count: one compiled variant of each kernel serves them all.
        partial = torch.empty(batch, heads, MAX_SPLITS, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, MAX_SPLITS, dtype=torch.float32, device=q.device)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)  # unread without STORE_NEW
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    decode_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        partial,
        lse,
        k_new,
        v_new,
        slots,
        k_scale if scaled else q,
        v_scale if scaled else q,  # unread unless KV_SCALED
        scale,
        window,
        softcap,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0) if splits > 1 else 0,
        lse.stride(1) if splits > 1 else 0,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_N=tile.block_n,
        SPLIT=splits > 1,
        IEEE_FP32=q.dtype == torch.float32 and not interpreted(),
        SOFTCAPPED=softcap > 0,
        STORE_NEW=new_kv is not None,
        FP8_MAX=fp8_max,
        KV_SCALED=scaled,
        **triton_launch_options(
            "decode",
            tile.num_warps,
            tile.num_stages,
            tile_mn=(group_pad, tile.block_n),
            block_k=min(dim_pad, tile.block_n),
        ),
    )
    if splits > 1:
        combine_kernel[(batch, heads)](
            partial,
            lse,
            out,
            splits,
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            MAX_SPLITS=MAX_SPLITS,
            **triton_launch_options("decode_combine", 1 if head_dim <= 64 else 2),
        )
    return out
