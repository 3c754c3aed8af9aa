"""Index layouts for torch_npu.npu_scatter_nd_update_, and a plain-torch reference of the op.

The op, as Ascend's torch_npu API reference documents it:

    torch_npu.npu_scatter_nd_update_(input, indices, updates) -> input (updated in place)

- `indices` has at least 2 dims and int32 or int64 dtype; its last dim `a` is the
  index depth, a <= input.dim(); every index vector addresses input[i0, ..., i(a-1)].
- updates.shape == indices.shape[:-1] + input.shape[a:]
  (input (4, 5, 6), indices (3, 2) -> updates (3, 6)).
- Out-of-range indices are not supported (no bounds check on device).

For the engine's per-layer caches [num_slots, kv_heads, head_dim] that gives two forms:

- slot-id form: indices [tokens, 1] int32 (= slot), updates [tokens, kv_heads, head_dim]
  (what SGLang's FIA path scatters through now: sgl-project/sglang
  python/sglang/srt/hardware_backend/npu/memory_pool_npu.py keeps its cache as
  [slots, 1, heads, dim] but notes that aclnnScatterNdUpdate on the deployed CANN rejects
  the 4-D [tokens, 1, heads, dim] update during tiling, so it scatters through this 3-D
  view; the 4-D form is the same write only on paper, in the reference below. Its default,
  non-FIA path writes with torch_npu._npu_reshape_and_cache, as vllm-ascend does);
- page form: cache viewed [num_pages, page_size, kv_heads, head_dim], indices
  [tokens, 2] = (slot // page_size, slot % page_size) (vllm-ascend's torchair path).

Both address one layer's tensor only: scattering into a multi-layer tensor made
graph compilation run out of memory (PLATFORM_NOTES), so callers pass per-layer views.
"""

from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32  # SGLang's NPU runner uses int32 slot indices; the op takes int32 or int64


def slot_scatter_indices(slot_indices: torch.Tensor) -> torch.Tensor:
    """[tokens] slot ids -> [tokens, 1] int32, contiguous (index depth 1)."""
    return slot_indices.reshape(-1, 1).to(INDEX_DTYPE).contiguous()


def page_scatter_indices(slot_indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """[tokens] slot ids -> [tokens, 2] int32 (page, offset) pairs (index depth 2)."""
    slots = slot_indices.reshape(-1).to(torch.int64)
    pairs = torch.stack([slots // page_size, slots % page_size], dim=-1)
    return pairs.to(INDEX_DTYPE).contiguous()


def paged_view(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_slots, heads, dim] -> [num_pages, page_size, heads, dim] (a view, no copy)."""
    if cache.shape[0] % page_size:
        raise ValueError(f"{cache.shape[0]} slots is not a multiple of page_size {page_size}")
    return cache.view(cache.shape[0] // page_size, page_size, *cache.shape[1:])


def updates_for(cache: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Reshape k or v ([tokens, heads, dim]) to the updates shape the op demands."""
    depth = indices.shape[-1]
    return values.reshape(*indices.shape[:-1], *cache.shape[depth:])


def check_scatter_args(cache: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> None:
    """Raise ValueError unless (cache, indices, updates) meet the documented constraints."""
    if indices.dim() < 2:
        raise ValueError(f"indices must have at least 2 dims, got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    depth = indices.shape[-1]
    if not 1 <= depth <= cache.dim():
        raise ValueError(f"index depth {depth} must be in 1..{cache.dim()} for a {cache.dim()}-d input")
    expected = tuple(indices.shape[:-1]) + tuple(cache.shape[depth:])
    if tuple(updates.shape) != expected:
        raise ValueError(f"updates must have shape {expected}, got {tuple(updates.shape)}")
    if updates.dtype != cache.dtype:
        raise ValueError(f"updates dtype {updates.dtype} differs from input dtype {cache.dtype}")


def scatter_nd_update_reference(cache: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """Plain-torch npu_scatter_nd_update_: cache[tuple(index)] = update for every index vector, in place.

    Bounds are checked here (the device op does not check them). With duplicate
    index vectors the surviving value is unspecified, as on the device.
    """
    check_scatter_args(cache, indices, updates)
    depth = indices.shape[-1]
    flat = indices.reshape(-1, depth).to(torch.int64)
    limits = torch.tensor(cache.shape[:depth], dtype=torch.int64, device=flat.device)
    if flat.numel() and (bool((flat < 0).any()) or bool((flat >= limits).any())):
        raise IndexError(f"scatter index out of range for input of shape {tuple(cache.shape)}")
    cache[tuple(flat.t())] = updates.reshape(-1, *cache.shape[depth:])
    return cache


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_size: int | None = None,
) -> None:
    """The NPU store_kv on any device: slot-id form, or the page form when page_size is given."""
    for cache, values in ((k_cache, k), (v_cache, v)):
        if page_size is None:
            target, indices = cache, slot_scatter_indices(slot_indices)
        else:
            target, indices = paged_view(cache, page_size), page_scatter_indices(slot_indices, page_size)
        scatter_nd_update_reference(target, indices, updates_for(target, indices, values))
