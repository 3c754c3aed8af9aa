"""Triton source of the paged decode kernels (imported only through backends.cuda.triton_decode)."""

import triton
import triton.language as tl

from backends.cuda.kernels.softcap import softcap_scores


# Integers that change from step to step are not specialised on (Triton would compile a variant per
# value class: 1, a multiple of 16, other). Cold, each variant is seconds of JIT in the middle of
# serving: offline 1,000 requests ran at 7,365-7,725 tok/s on a cold cache and 9,606 on a warm one.
@triton.jit(do_not_specialize=["window", "stride_pb"])
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale,
    window,
    softcap,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    SOFTCAPPED: tl.constexpr = False,
):
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + batch)
    # A sliding window (window > 0): only the last `window` positions are attended to.
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    # This program's range of the context, in whole blocks (SPLITS == 1: all of it).
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, SPLITS), BLOCK_N) * BLOCK_N
    begin = lo + split * per_split
    end = tl.minimum(begin + per_split, seq_len)
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
    for start in range(begin, end, BLOCK_N):
        tokens = start + offs_n
        valid = tokens < end
        page = tl.load(page_table_ptr + batch * stride_pb + tokens // PAGE_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + tokens % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        # An FP8 cache (--kv-cache-dtype fp8_e4m3) is widened in registers: every e4m3 value is exact in q's dtype.
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        if SOFTCAPPED:
            qk = softcap_scores(qk, softcap)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE_FP32:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_mask = g_mask[:, None] & d_mask[None, :]
    out_offsets = batch * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + out_offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # An empty range (past the end of a short context) leaves l_i == 0: log-sum-exp -inf, weight 0.
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + out_offsets, acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(lse_ptr + batch * stride_lb + heads * stride_lh + split, lse, mask=g_mask)

@triton.jit
def combine_splits_kernel(
    partial_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + batch * stride_lb + head * stride_lh + offs_s)
    weights = tl.exp(lse - tl.max(lse, 0))  # the first split is never empty: max is finite
    partial = tl.load(
        partial_ptr + batch * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=d_mask[None, :], other=0.0,
    )
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
