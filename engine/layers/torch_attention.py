"""Paged attention in plain torch ops: the CPU backend and the prefill path everywhere.

Decode runs as one opaque custom op (`engine::paged_decode_attention`) so that a
compiled decode graph (torch.compile, dynamic=False) never sees the context
length: the op gathers exactly the pages each step needs, however long the
contexts are, without recompiling.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionBackend, AttentionCapabilities, AttentionMetadata
from engine.layers.ops import define_decode_attention_op


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

    context_slots: torch.Tensor  # [B * L] slot of every context position, L = longest context
    batch_size: int
    context_len: int
    mask: torch.Tensor | None  # [B, 1, 1, L] additive mask, None when every context has length L
    # A single request whose pages are consecutive (the allocator hands out low ids first, so
    # this is the common case): its context is one slice of the cache, read without a copy.
    contiguous_start: int | None = None
    seq_lens: torch.Tensor | None = None  # [B], for the sliding-window masks
    window_masks: dict[int, torch.Tensor] | None = None  # window -> [B, 1, 1, L] additive mask (built once a step)

    def mask_for(self, window: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The step's mask, with positions before each row's last `window` also masked (window > 0)."""
        if window <= 0 or self.context_len <= window:
            return self.mask  # every key of every row is inside the window
        if self.window_masks is None:
            self.window_masks = {}
        if window not in self.window_masks:
            assert self.seq_lens is not None
            positions = torch.arange(self.context_len, device=self.context_slots.device)
            lengths = self.seq_lens.to(torch.int64).unsqueeze(1)
            outside = (positions < lengths - window) | (positions >= lengths)
            mask = torch.zeros(outside.shape, dtype=dtype, device=outside.device).masked_fill_(outside, float("-inf"))
            self.window_masks[window] = mask[:, None, None, :]
        return self.window_masks[window]

    @classmethod
    def build(cls, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, dtype: torch.dtype) -> DecodePlan:
        lengths = seq_lens.tolist() if seq_lens.device.type == "cpu" else None
        max_len = max(lengths) if lengths is not None else int(seq_lens.max())
        positions = torch.arange(max_len, device=page_table.device)
        pages = page_table[:, positions // page_size].long() if page_size > 1 else page_table[:, :max_len].long()
        slots = pages * page_size + positions % page_size if page_size > 1 else pages
        mask = None
        if lengths is None or min(lengths) != max_len:
            # Padded rows and shorter contexts: -inf past each row's length (SDPA adds it to the scores).
            valid = positions < seq_lens.unsqueeze(1).to(torch.int64)
            mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, None, :]
        contiguous_start = None
        if lengths is not None and len(lengths) == 1:
            row = slots[0]
            # Every step must be +1: first and last alone can line up by chance once pages are
            # recycled out of order (prefix-cache eviction hands back arbitrary pages).
            if max_len == 1 or bool((row[1:] - row[:-1] == 1).all()):
                contiguous_start = int(row[0])
        return cls(slots.reshape(-1), page_table.shape[0], max_len, mask, contiguous_start, seq_lens)


# Per thread: two engines stepping in two threads (servers in one process) must not see each other's plan.
_plans = threading.local()


@contextmanager
def decode_plan(meta: AttentionMetadata, dtype: torch.dtype) -> Iterator[DecodePlan]:
    """Make one step's plan visible to every layer's paged_decode_attention call."""
    plan = DecodePlan.build(meta.page_table, meta.seq_lens, meta.page_size, dtype)
    previous = getattr(_plans, "current", None)
    _plans.current = plan
    try:
        yield plan
    finally:
        _plans.current = previous


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
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per request: store its k/v, attend over its pages (its last `window` positions
    with a sliding window > 0; scores soft-capped with softcap > 0). q [B, H, D] -> [B, H, D]."""
    k_cache.index_copy_(0, slot_indices, k)
    v_cache.index_copy_(0, slot_indices, v)
    plan = getattr(_plans, "current", None)
    if plan is None or plan.batch_size != q.shape[0]:
        plan = DecodePlan.build(page_table, seq_lens, page_size, q.dtype)
    shape = (plan.batch_size, plan.context_len, k_cache.shape[1], k_cache.shape[2])
    if plan.contiguous_start is not None:
        keys = k_cache.narrow(0, plan.contiguous_start, plan.context_len).view(shape).transpose(1, 2)
        values = v_cache.narrow(0, plan.contiguous_start, plan.context_len).view(shape).transpose(1, 2)
    else:
        # index_select on flat slots: ~3x cheaper per call than advanced indexing on CPU.
        keys = k_cache.index_select(0, plan.context_slots).view(shape).transpose(1, 2)  # [B, KVH, L, D]
        values = v_cache.index_select(0, plan.context_slots).view(shape).transpose(1, 2)
    mask = plan.mask_for(window, q.dtype)
    mask = mask if mask is None or mask.dtype == q.dtype else mask.to(q.dtype)
    out = attention_over(q.unsqueeze(2), keys, values, mask, scale, softcap)  # q [B, H, 1, D]
    return out.squeeze(2)


def attention_over(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
    causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ mask]) v over [..., heads, n, D] queries and [..., kv_heads, L, D] keys
    (GQA); mask additive or boolean (True: visible). SDPA, unless scores are soft-capped (Gemma 2:
    softcap * tanh(score / softcap), which SDPA cannot do): then in explicit float32 math."""
    gqa = query.shape[-3] != keys.shape[-3]
    if not softcap:
        if query.dim() == 3:
            # A batch dimension of 1: on the CPU, SDPA picks its flash kernel only for 4-D inputs and falls back
            # to the math path (scores materialized, then softmax) for [heads, n, D]: 6x slower for a 1,500-token
            # prompt (134 against 22 ms a layer, SmolLM2's 9 heads, 2 threads), with or without a mask.
            return F.scaled_dot_product_attention(
                query[None], keys[None], values[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
            )[0]
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if gqa:
        group = query.shape[-3] // keys.shape[-3]
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, length = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=scores.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(query.dtype)


define_decode_attention_op("paged_decode_attention", paged_decode_attention)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Ragged prefill (with or without a cached prefix), one SDPA per request; each query sees its
    last `window` positions with a sliding window > 0; scores soft-capped with softcap > 0."""
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
        windowed = 0 < window < seq_len
        if prefix == 0 and not windowed:
            attn = attention_over(query, keys, values, None, scale, softcap, causal=True)
        else:
            rows = torch.arange(num_new, device=q.device).unsqueeze(1) + prefix
            keys_at = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = keys_at <= rows
            if windowed:
                mask &= keys_at > rows - window
            attn = attention_over(query, keys, values, mask, scale, softcap)
        out[start:end] = attn.transpose(0, 1)
    return out


class TorchAttentionBackend(AttentionBackend):
    """Attention in torch ops; decode through the opaque custom op above."""

    name = "torch"
    capabilities = AttentionCapabilities(sliding_window=True, softcap=True)

    def __init__(self, kv_dtype: torch.dtype = torch.float32) -> None:
        self.kv_dtype = kv_dtype  # of the KV cache (what q is cast to), for the additive mask

    def step_context(self, meta: AttentionMetadata) -> AbstractContextManager[DecodePlan | None]:
        """Around one forward pass: decode steps share one DecodePlan across layers."""
        return decode_plan(meta, self.kv_dtype) if meta.is_decode else nullcontext()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        out_dtype = q.dtype
        if k_cache.dtype != q.dtype:
            # A float32 cache under a bfloat16 model (the CPU default): attention runs in float32,
            # where this CPU's SDPA is ~6x faster than in bfloat16 at batch 16, and more accurate.
            q, k, v = q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)
        if meta.is_decode:
            out = self.decode(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        else:
            k_cache.index_copy_(0, meta.slot_indices, k)
            v_cache.index_copy_(0, meta.slot_indices, v)
            out = extend_attention(q, k_cache, v_cache, meta, scale, window, softcap)
        return out.to(out_dtype)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """One query token per request, q already in the cache's dtype; subclasses swap the op."""
        return torch.ops.engine.paged_decode_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_indices,
            meta.page_table,
            meta.seq_lens,
            meta.page_size,
            scale,
            window,
            softcap,
        )
