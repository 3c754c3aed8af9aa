"""Triton source of the paged decode kernels (imported only through backends.cuda.triton_decode)."""

import triton
import triton.language as tl

from backends.cuda.kernels.softcap import softcap_scores


# Integers that change from step to step are not specialised on (Triton would compile a variant per
# value class: 1, a multiple of 16, other). Cold, each variant is seconds of JIT in the middle of
# serving: offline 1,000 requests ran at 7,365-7,725 tok/s on a cold cache and 9,606 on a warm one.
# The split count is one of them: as a constexpr it made five variants (1, 2, 4, 8, 16), each compiled
# while capturing the decode sizes and again, without the fused store, by the first mixed steps.
@triton.jit(do_not_specialize=["window", "stride_pb", "splits"])
def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    k_new_ptr,
    v_new_ptr,
    slots_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    window,
    softcap,
    splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    SOFTCAPPED: tl.constexpr = False,
    STORE_NEW: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 0.0,
    KV_SCALED: tl.constexpr = False,
):
    # STORE_NEW: this step's k/v rows (k_new, v_new: [B, KVH, D], one token per request, at position
    # seq_len - 1) are stored here instead of by separate copies before the launch: the program whose
    # range holds that position writes them to the request's slot (saturated to +-FP8_MAX first for an
    # FP8 cache), and every program reads that position's k/v from k_new/v_new instead of the cache,
    # so no program reads a slot this launch writes. Two index_copy_ kernels a layer (six for an FP8 cache)
    # disappear from every decode graph. Values pass through the cache's dtype first, so the attention
    # sees exactly what later steps will read back.
    # KV_SCALED: the cache holds k / k_scale and v / v_scale (per-tensor float32 scalars on the device,
    # checkpoint-calibrated; vLLM's k_scale / v_scale). k_scale is folded into the score scale and
    # v_scale into the output (softmax weights are linear in v), so the tile loop does no extra work.
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + batch)
    # A sliding window (window > 0): only the last `window` positions are attended to.
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    # This program's range of the context, in whole blocks (not SPLIT: all of it, splits == 1).
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, splits), BLOCK_N) * BLOCK_N
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
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    new_pos = seq_len - 1
    k_scale = 1.0  # unscaled: dividing by 1.0 is exact, so these variants compute as before
    v_scale = 1.0
    if KV_SCALED:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    qk_scale = scale * k_scale
    if STORE_NEW:
        if (begin <= new_pos) & (new_pos < end):  # this program's range holds the new position: store it
            k_new = tl.load(k_new_ptr + batch * stride_nkb + kv_head * stride_nkh + offs_d, mask=d_mask, other=0.0)
            v_new = tl.load(v_new_ptr + batch * stride_nvb + kv_head * stride_nvh + offs_d, mask=d_mask, other=0.0)
            if FP8_MAX > 0:
                k_new = tl.minimum(tl.maximum(k_new.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
                v_new = tl.minimum(tl.maximum(v_new.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
            new_slot = tl.load(slots_ptr + batch).to(tl.int64)
            tl.store(
                k_ptr + new_slot * stride_ks + kv_head * stride_kh + offs_d,
                k_new.to(k_ptr.dtype.element_ty),
                mask=d_mask,
            )
            tl.store(
                v_ptr + new_slot * stride_vs + kv_head * stride_vh + offs_d,
                v_new.to(v_ptr.dtype.element_ty),
                mask=d_mask,
            )
        if FP8_MAX > 0:
            # The new row as every later step will read it back (saturated, rounded through e4m3), computed
            # once here: rounding it per tile inside the loop ([BLOCK_N, D] divides, clamps and two casts
            # per tile for one live row) made the FP8 cache's steps ALU-bound at large batch.
            k_new_row = tl.load(k_new_ptr + batch * stride_nkb + kv_head * stride_nkh + offs_d, mask=d_mask, other=0.0)
            v_new_row = tl.load(v_new_ptr + batch * stride_nvb + kv_head * stride_nvh + offs_d, mask=d_mask, other=0.0)
            k_new_row = tl.minimum(tl.maximum(k_new_row.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
            v_new_row = tl.minimum(tl.maximum(v_new_row.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
            k_new_row = k_new_row.to(k_ptr.dtype.element_ty).to(q.dtype)
            v_new_row = v_new_row.to(v_ptr.dtype.element_ty).to(q.dtype)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for start in range(begin, end, BLOCK_N):
        tokens = start + offs_n
        valid = tokens < end
        page = tl.load(page_table_ptr + batch * stride_pb + tokens // PAGE_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + tokens % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k_ptrs = k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        # The new position's row is read from k_new/v_new, never from the slot this launch writes. With the
        # cache's own dtype that is a pointer choice per row (nothing held across the loop: registers stay
        # as without the store); an FP8 cache's row is the one rounded before the loop, selected per row.
        if STORE_NEW:
            is_new = (tokens == new_pos)[:, None]
            if FP8_MAX > 0:
                kv_mask = kv_mask & (is_new == 0)
            else:
                k_new_ptrs = k_new_ptr + batch * stride_nkb + kv_head * stride_nkh + offs_d[None, :] + 0 * slot[:, None]
                v_new_ptrs = v_new_ptr + batch * stride_nvb + kv_head * stride_nvh + offs_d[None, :] + 0 * slot[:, None]
                k_ptrs = tl.where(is_new, k_new_ptrs, k_ptrs)
                v_ptrs = tl.where(is_new, v_new_ptrs, v_ptrs)
        # An FP8 cache (--kv-cache-dtype fp8_e4m3) is widened in registers: every e4m3 value is exact in q's dtype.
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        if STORE_NEW and FP8_MAX > 0:
            k = tl.where(is_new, k_new_row[None, :], k)
        if IEEE_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * qk_scale
        if SOFTCAPPED:
            qk = softcap_scores(qk, softcap)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        if STORE_NEW and FP8_MAX > 0:
            v = tl.where(is_new, v_new_row[None, :], v)
        if IEEE_FP32:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_mask = g_mask[:, None] & d_mask[None, :]
    out_offsets = batch * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    if KV_SCALED:  # the splits' partial outputs are combined linearly: each may take v_scale itself
        acc = acc * v_scale
    if not SPLIT:
        tl.store(out_ptr + out_offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # An empty range (past the end of a short context) leaves l_i == 0: log-sum-exp -inf, weight 0.
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + out_offsets, acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(lse_ptr + batch * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["splits"])
def combine_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    s_mask = offs_s < splits
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + batch * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # the first split is never empty: max is finite
    partial = tl.load(
        partial_ptr + batch * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
