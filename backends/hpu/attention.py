"""Flat paged attention for Gaudi decode (vllm-gaudi's flat_pa layout), in plain static-shape torch ops.

Gaudi compiles one recipe per tensor shape, so decode attention must not depend on
the context length. A 2-D page table cut to the longest row would; vllm-gaudi's
*flat* layout does not: the blocks (KV pages) of all rows are listed one after
another in ``block_list`` and padded to a bucketed length, and every per-row
quantity is moved between rows and blocks with a ``[blocks, bs]`` one-hot matmul
(``block_mapping``). Every op below has shapes fixed by (bs, blocks), so one
compiled recipe (or HPU graph) per bucket serves every batch in it, and the same
code runs on CPU for tests.

Per block b of row r = block_groups[b]:
  scores_b = q_r . K_b / sqrt(d)   masked to the first block_usage[b] tokens,
  m_b = max(scores_b), s_b = sum(exp(scores_b - m_b)), o_b = exp(scores_b - m_b) . V_b
then per row, with M_r the max of its blocks' m_b (an index_reduce over groups):
  out_r = sum_b exp(m_b - M_r) o_b / sum_b exp(m_b - M_r) s_b.
Subtracting the row max M_r (not a global one) keeps every row's sum away from
underflow however different the rows' scores are. Rows always own >= 1 block with
usage >= 1 (padded rows read one slot of page 0), so the denominator is never 0.

UNTESTED ON GAUDI HARDWARE: checked on CPU against engine.layers.torch_attention.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from backends.hpu.bucketing import build_block_metadata
from engine.layers.attention import AttentionMetadata
from engine.layers.torch_attention import extend_attention

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class HpuFlatMetadata:
    """What flat_paged_attention reads; AttentionMetadata.platform_metadata on HPU decode steps."""

    block_list: torch.Tensor  # [blocks] int64 page ids, row after row, filler page 0
    block_groups: torch.Tensor  # [blocks] int64 row of each block; bs for filler blocks
    block_mapping: torch.Tensor  # [blocks, bs] one-hot of block_groups (zero rows for filler)
    block_bias: torch.Tensor  # [blocks, page_size] 0 for used tokens, -inf past block_usage

    @classmethod
    def from_block_metadata(
        cls,
        block_list: torch.Tensor,
        block_groups: torch.Tensor,
        block_usage: torch.Tensor,
        block_mapping: torch.Tensor,
        page_size: int,
    ) -> "HpuFlatMetadata":
        """Device-side, static-shape: runs inside the compiled step once per step (not per layer)."""
        # Compared in fp32: block_usage may arrive in bf16 (the model dtype), exact only up to 256.
        offsets = torch.arange(page_size, device=block_usage.device, dtype=torch.float32)
        masked = offsets.unsqueeze(0) >= block_usage.float().unsqueeze(1)
        bias = torch.zeros(masked.shape, dtype=block_mapping.dtype, device=block_mapping.device)
        bias = bias.masked_fill(masked, float("-inf"))
        return cls(block_list.long(), block_groups.long(), block_mapping, bias)

    @classmethod
    def from_page_table(
        cls, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, dtype: torch.dtype
    ) -> "HpuFlatMetadata":
        """For eager steps that no runner padded: exactly the blocks the batch needs (data-dependent shape)."""
        blocks = _count_blocks(seq_lens, page_size)
        host = build_block_metadata(page_table.cpu(), seq_lens.cpu(), page_size, blocks, dtype)
        device = page_table.device
        return cls.from_block_metadata(
            host.block_list.to(device), host.block_groups.to(device), host.block_usage.to(device),
            host.block_mapping.to(device), page_size,
        )  # fmt: skip


def _count_blocks(seq_lens: torch.Tensor, page_size: int) -> int:
    return int(((seq_lens.to(torch.int64) + page_size - 1) // page_size).sum())


def flat_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: HpuFlatMetadata,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q [bs, heads, dim], caches [slots, kv_heads, dim] -> [bs, heads, dim]; see the module docstring."""
    bs, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    blocks = meta.block_list.shape[0]
    mapping = meta.block_mapping.to(q.dtype)
    # batch2block: every block gets the (scaled) query of its row; filler blocks get zeros.
    q_blocks = (mapping @ (q * scale).reshape(bs, heads * dim)).view(blocks, kv_heads, group, dim)
    # Gather whole pages: the cache viewed as [pages, page_size, kv_heads, dim] (a view, no copy).
    keys = k_cache.view(-1, page_size, kv_heads, dim).index_select(0, meta.block_list)
    values = v_cache.view(-1, page_size, kv_heads, dim).index_select(0, meta.block_list)
    # GQA without repeating K/V: the query heads of one kv head form a [group, dim] matrix.
    scores = torch.matmul(q_blocks, keys.permute(0, 2, 3, 1))  # [blocks, kv_heads, group, page_size]
    # Softmax statistics in fp32 even for bf16 caches: exp/sum of up to page_size terms per block.
    scores = scores.float() + meta.block_bias.float().view(blocks, 1, 1, page_size)
    block_max = scores.amax(dim=-1)  # [blocks, kv_heads, group]
    probs = torch.exp(scores - block_max.unsqueeze(-1))
    block_sum = probs.sum(dim=-1)
    partial = torch.matmul(probs.to(values.dtype), values.permute(0, 2, 1, 3))  # [blocks, kv_heads, group, dim]
    # Row max over the row's blocks; filler blocks reduce into an extra row `bs` that is dropped.
    # index_reduce is what vllm-gaudi runs on Gaudi for this (CPU torch calls it beta, once).
    row_max = torch.full((bs + 1, kv_heads, group), float("-inf"), dtype=block_max.dtype, device=q.device)
    row_max = row_max.index_reduce(0, meta.block_groups, block_max, "amax")
    rescale = torch.exp(block_max - row_max.index_select(0, meta.block_groups))  # [blocks, kv_heads, group]
    # block2batch: mapping^T sums the rescaled blocks of each row (filler rows of mapping are zero).
    mapping_t = mapping.t().to(torch.float32)
    row_sum = mapping_t @ (block_sum * rescale).view(blocks, -1)  # [bs, kv_heads * group]
    out = mapping_t @ (partial.float() * rescale.unsqueeze(-1)).view(blocks, -1)  # [bs, kv_heads * group * dim]
    out = out.view(bs, kv_heads, group, dim) / row_sum.view(bs, kv_heads, group, 1)
    return out.reshape(bs, heads, dim).to(q.dtype)


def _hpu_store_kv() -> StoreFn:
    from backends.hpu.platform import HpuPlatform

    return HpuPlatform().store_kv


class HpuAttentionBackend:
    """Decode: index_copy_ store + flat paged attention; extend: the same store + torch extend attention."""

    name = "hpu_flat"

    def __init__(self, store_kv: StoreFn | None = None) -> None:
        # HpuPlatform.store_kv: index_copy_ along slots, int64 indices, static per bucket.
        self.store_kv = store_kv if store_kv is not None else _hpu_store_kv()

    @contextmanager
    def step_context(self, meta: AttentionMetadata) -> Iterator[None]:
        """Around one eager forward pass: an unpadded decode step gets its flat layout once, not per layer."""
        if not meta.is_decode or meta.platform_metadata is not None:
            yield
            return
        # fp32 mapping: flat_paged_attention casts it to the query dtype anyway.
        flat = HpuFlatMetadata.from_page_table(meta.page_table, meta.seq_lens, meta.page_size, torch.float32)
        meta.platform_metadata = flat
        try:
            yield
        finally:
            meta.platform_metadata = None

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
        self.store_kv(k_cache, v_cache, meta.slot_indices, k, v)
        if not meta.is_decode:
            return extend_attention(q, k_cache, v_cache, meta, scale)
        flat = meta.platform_metadata
        if not isinstance(flat, HpuFlatMetadata):
            # An eager decode step (graphs off, or a batch beyond every bucket): build the
            # layout here, per layer. Correct, but a new shape for the graph compiler.
            flat = HpuFlatMetadata.from_page_table(meta.page_table, meta.seq_lens, meta.page_size, q.dtype)
        return flat_paged_attention(q, k_cache, v_cache, flat, meta.page_size, scale)
