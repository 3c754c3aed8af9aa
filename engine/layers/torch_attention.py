"""Paged attention in plain torch ops: the CPU backend and the prefill path everywhere.

Decode runs as one opaque custom op (`engine::paged_decode_attention`) so that a
compiled decode graph (torch.compile, dynamic=False) never sees the context
length: the op gathers exactly the pages each step needs, however long the
contexts are, without recompiling.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

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


@dataclass
class DecodePlan:
    """What every layer's decode attention shares in one step: which slots to read, which to mask.

    Built once per step instead of once per layer (30x fewer host-side ops on
    SmolLM2); published to the custom op through `decode_plan`, as vLLM's
    forward context publishes attention metadata to its attention op.
    """

    context_slots: torch.Tensor  # [B, L] slot of every context position (L = longest context, page-rounded)
    mask: torch.Tensor  # [B, 1, 1, L] True where the position is part of the context

    @classmethod
    def build(cls, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> "DecodePlan":
        max_len = int(seq_lens.max())
        num_pages = (max_len + page_size - 1) // page_size
        pages = page_table[:, :num_pages].long()
        if page_size == 1:
            slots = pages
        else:
            offsets = torch.arange(page_size, device=pages.device, dtype=torch.int64)
            slots = (pages.unsqueeze(-1) * page_size + offsets).flatten(-2)
        positions = torch.arange(slots.shape[1], device=slots.device)
        mask = positions < seq_lens.unsqueeze(1).to(torch.int64)
        return cls(slots, mask[:, None, None, :])


_current_plan: DecodePlan | None = None


@contextmanager
def decode_plan(meta: AttentionMetadata) -> Iterator[DecodePlan]:
    """Make one step's plan visible to every layer's paged_decode_attention call."""
    global _current_plan
    plan = DecodePlan.build(meta.page_table, meta.seq_lens, meta.page_size)
    previous, _current_plan = _current_plan, plan
    try:
        yield plan
    finally:
        _current_plan = previous


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
    plan = _current_plan
    if plan is None or plan.context_slots.shape[0] != q.shape[0]:
        plan = DecodePlan.build(page_table, seq_lens, page_size)
    keys = k_cache[plan.context_slots].transpose(1, 2)  # [B, KVH, L, D]
    values = v_cache[plan.context_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        keys,
        values,
        attn_mask=plan.mask,
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

    def step_context(self, meta: AttentionMetadata):  # noqa: ANN201
        """Around one forward pass: decode steps share one DecodePlan across layers."""
        return decode_plan(meta) if meta.is_decode else nullcontext()

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
