"""Paged attention in plain torch ops: the CPU backend and the prefill path everywhere.

Decode runs as one opaque custom op (`engine::paged_decode_attention`) so that a
compiled decode graph (torch.compile, dynamic=False) never sees the context
length: the op gathers exactly the pages each step needs, however long the
contexts are, without recompiling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionMetadata


def gather_context(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """cache [slots, kv_heads, dim], pages [..., n] page ids -> [..., n * page_size, kv_heads, dim]."""
    if page_size == 1:
        return cache[pages.long()]
    offsets = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    slots = (pages.long().unsqueeze(-1) * page_size + offsets).flatten(-2)
    return cache[slots]


@torch.library.custom_op("engine::paged_decode_attention", mutates_args=("k_cache", "v_cache"))
def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_indices: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """One query token per request: store its k/v, attend over its pages. q [B, H, D] -> [B, H, D]."""
    k_cache.index_copy_(0, slot_indices, k)
    v_cache.index_copy_(0, slot_indices, v)
    max_len = int(seq_lens.max())
    num_pages = (max_len + page_size - 1) // page_size
    pages = page_table[:, :num_pages]
    keys = gather_context(k_cache, pages, page_size).transpose(1, 2)  # [B, KVH, L, D]
    values = gather_context(v_cache, pages, page_size).transpose(1, 2)
    length = keys.shape[2]
    mask = torch.arange(length, device=q.device) < seq_lens.unsqueeze(1).to(torch.int64)  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.squeeze(2)


@paged_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_indices, page_table, seq_lens, page_size, scale):  # noqa: ANN001
    return torch.empty_like(q)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Ragged prefill (with or without a cached prefix), one SDPA per request."""
    assert meta.query_start_loc is not None and meta.seq_lens_cpu is not None
    out = torch.empty_like(q)
    page_size = meta.page_size
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        num_new = end - start
        num_pages = (seq_len + page_size - 1) // page_size
        pages = meta.page_table[i, :num_pages]
        keys = gather_context(k_cache, pages, page_size)[:seq_len].transpose(0, 1)  # [KVH, L, D]
        values = gather_context(v_cache, pages, page_size)[:seq_len].transpose(0, 1)
        query = q[start:end].transpose(0, 1)  # [H, n, D]
        prefix = seq_len - num_new
        if prefix == 0:
            attn = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=query.shape[0] != keys.shape[0]
            )
        else:
            rows = torch.arange(num_new, device=q.device).unsqueeze(1) + prefix
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=query.shape[0] != keys.shape[0]
            )
        out[start:end] = attn.transpose(0, 1)
    return out


class TorchAttentionBackend:
    """Attention in torch ops; decode through the opaque custom op above."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.is_decode:
            return torch.ops.engine.paged_decode_attention(
                q, k, v, k_cache, v_cache, meta.slot_indices, meta.page_table, meta.seq_lens, meta.page_size, scale
            )
        k_cache.index_copy_(0, meta.slot_indices, k)
        v_cache.index_copy_(0, meta.slot_indices, v)
        return extend_attention(q, k_cache, v_cache, meta, scale)
