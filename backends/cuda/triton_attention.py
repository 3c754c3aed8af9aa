"""Paged decode attention as one Triton kernel (CUDA and ROCm), safe to capture in a graph.

One program per (request, kv head) walks that request's pages up to its
sequence length (read on the device, so one captured graph serves any
context length) with an online softmax over the GQA group of query heads.
Prefill stays on torch SDPA per request (engine.layers.torch_attention).
"""

from __future__ import annotations

import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.ops import define_decode_attention_op
from engine.layers.torch_attention import extend_attention

_KERNEL = None


def _build_kernel():  # noqa: ANN202
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr,
        scale,
        stride_qb, stride_qh,
        stride_ks, stride_kh,
        stride_vs, stride_vh,
        stride_pb,
        stride_ob, stride_oh,
        PAGE_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE_FP32: tl.constexpr,
    ):
        batch = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + batch)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, DIM_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            tokens = start + offs_n
            valid = tokens < seq_len
            page = tl.load(page_table_ptr + batch * stride_pb + tokens // PAGE_SIZE, mask=valid, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + tokens % PAGE_SIZE
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            if IEEE_FP32:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(valid[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            if IEEE_FP32:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )

    return paged_decode_kernel


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D], caches [slots, KVH, D] -> [B, H, D]."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build_kernel()
    import triton

    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    block_n = 64 if head_dim <= 128 else 32
    _KERNEL[(batch, kv_heads)](
        q, k_cache, v_cache, page_table, seq_lens, out,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        IEEE_FP32=q.dtype == torch.float32,
        num_warps=4,
    )
    return out


def triton_paged_decode(
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
    """Store this step's k/v, then the Triton kernel; one opaque op so torch.compile leaves both alone."""
    k_cache.index_copy_(0, slot_indices, k)
    v_cache.index_copy_(0, slot_indices, v)
    return paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, page_size, scale)


define_decode_attention_op("triton_paged_decode", triton_paged_decode)


class TritonAttentionBackend:
    """Decode through the Triton kernel; KV stored with index_copy_ (capturable)."""

    name = "triton"

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
            return torch.ops.engine.triton_paged_decode(
                q, k, v, k_cache, v_cache, meta.slot_indices, meta.page_table, meta.seq_lens, meta.page_size, scale
            )
        k_cache.index_copy_(0, meta.slot_indices, k)
        v_cache.index_copy_(0, meta.slot_indices, v)
        return extend_attention(q, k_cache, v_cache, meta, scale)
