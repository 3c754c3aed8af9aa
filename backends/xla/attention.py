"""Paged attention in plain torch ops that trace to XLA through torchax: no custom op, no host value.

The engine's own attention ops (engine::paged_decode_attention, engine::step_attention) are opaque custom
ops with no JAX lowering, and its extend path loops over requests with host lists; neither can be traced.
Here every shape is static per program: a decode program attends each row over its whole page-table row
(max_model_len keys, masked past the row's length), a prefill program one request's chunk over its row,
each query token masked past its own position. KV writes are a scatter at the slot tensors, which XLA
does in place in the donated cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.attention import AttentionBackend, AttentionCapabilities, AttentionMetadata
from engine.layers.torch_attention import extend_attention


@dataclass
class XlaChunkMetadata:
    """A prefill program's per-token positions (meta.platform_metadata): one request's chunk, padded."""

    positions: torch.Tensor  # [tokens] int64


def context_slots(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[rows, pages] page ids -> [rows, pages * page_size] the slot of every context position."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=page_table.device)
    return (page_table.to(torch.int64).unsqueeze(-1) * page_size + offsets).flatten(-2)


def store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots[i]] = rows[i], in place: [slots, KVH, D] <- [N, KVH, D].

    scatter_ with an element-wise index, not index_copy_: torchax lowers index_copy_ at one slot to a
    dynamic-update-slice, which XLA's CPU fusion duplicates into the gather that reads the cache afterwards; that
    read of the donated buffer's old contents then makes XLA copy every layer's whole cache at the start of each
    program (SmolLM2, a 16k-token pool: 936 ms a decode step, against 61 ms with this scatter, which XLA does
    not fuse into its readers and updates in place)."""
    cache.scatter_(0, slots[:, None, None].expand_as(rows), rows)


def masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v: query [N, H, T, D], keys/values [N, KVH, L, D] (GQA), visible a bool
    [N, 1, T, L]. Explicit math (no SDPA): every op has a torchax lowering, and the scores are float32. The query
    heads of one KV head are grouped against it rather than the keys repeated per head: no [N, H, L, D] copy."""
    n, heads, tokens, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    grouped = query.float().reshape(n, kv_heads, group * tokens, dim)  # head h reads KV head h // group
    scores = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale  # [N, KVH, group * T, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n, kv_heads, group, tokens, length).masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n, kv_heads, group * tokens, length)
    out = torch.matmul(probs, values.float())  # [N, KVH, group * T, D]
    return out.view(n, heads, tokens, dim).to(query.dtype)


def visible_keys(query_positions: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """[..., T] query positions -> [..., T, length] bool: key j is visible at position p iff j <= p (and
    j > p - window with a sliding window)."""
    keys_at = torch.arange(length, dtype=torch.int64, device=query_positions.device)
    positions = query_positions.to(torch.int64).unsqueeze(-1)
    visible = keys_at <= positions
    if window > 0:
        visible = visible & (keys_at > positions - window)
    return visible


class XlaAttentionBackend(AttentionBackend):
    """Attention inside the XLA step programs (backends/xla/programs.py). Eager steps (a test's, on CPU
    tensors) take the engine's torch extend path for ragged batches without chunk metadata."""

    name = "xla"
    capabilities = AttentionCapabilities(sliding_window=True, softcap=True)

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
            q, k, v = q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)
        # Every token's k/v stored before any attends (a verify step's drafts see each other, a chunk's tokens each
        # other): a scatter into the donated cache, which XLA does in place (store says why not index_copy_).
        slots = meta.slot_indices.to(torch.int64)
        store(k_cache, slots, k)
        store(v_cache, slots, v)
        if meta.is_decode:
            out = self._decode(q, k_cache, v_cache, meta, scale, window, softcap)
        elif isinstance(meta.platform_metadata, XlaChunkMetadata):
            out = self._chunk(q, k_cache, v_cache, meta, meta.platform_metadata, scale, window, softcap)
        else:  # an eager ragged batch (host tensors): the engine's torch path
            out = extend_attention(q, k_cache, v_cache, meta, scale, window, softcap)
        return out.to(out_dtype)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        """One query per row, over its page-table row: q [B, H, D] -> [B, H, D]."""
        slots = context_slots(meta.page_table, meta.page_size)  # [B, L]
        batch, length = slots.shape
        keys = k_cache.index_select(0, slots.reshape(-1))
        values = v_cache.index_select(0, slots.reshape(-1))
        keys = keys.view(batch, length, *k_cache.shape[1:]).transpose(1, 2)  # [B, KVH, L, D]
        values = values.view(batch, length, *v_cache.shape[1:]).transpose(1, 2)
        positions = (meta.seq_lens.to(torch.int64) - 1).unsqueeze(-1)  # [B, 1]
        visible = visible_keys(positions, length, window).unsqueeze(1)  # [B, 1, 1, L]
        return masked_attention(q.unsqueeze(2), keys, values, visible, scale, softcap).squeeze(2)

    @staticmethod
    def _chunk(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        chunk: XlaChunkMetadata,
        scale: float,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        """One request's chunk (its cached prefix in the pages too): q [T, H, D] -> [T, H, D]."""
        slots = context_slots(meta.page_table[:1], meta.page_size)[0]  # [L]
        length = slots.shape[0]
        keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        visible = visible_keys(chunk.positions, length, window)[None, None]  # [1, 1, T, L]
        query = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        return masked_attention(query, keys, values, visible, scale, softcap)[0].transpose(0, 1)
