"""Triton source of the ragged paged attention kernel (imported only through backends.cuda.triton_extend)."""

import triton
import triton.language as tl

from backends.cuda.kernels.softcap import softcap_scores


@triton.jit
def _find_request(query_start_ptr, num_requests, block, BLOCK_Q: tl.constexpr):
    # Request i's blocks start at query_start[i] // BLOCK_Q + i (each request rounds up to a whole block).
    low: tl.int32 = 0
    high: tl.int32 = num_requests
    while low < high:
        mid = (low + high) // 2
        start = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if start <= block:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    qk_scale,
    start,
    end,
    row_pos,
    window,
    softcap,
    k_ptr,
    v_ptr,
    table_row_ptr,
    kv_head,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    offs_n,
    offs_d,
    d_mask,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    SOFTCAPPED: tl.constexpr,
):
    tokens = start + offs_n
    valid = tokens < end
    page = tl.load(table_row_ptr + tokens // PAGE_SIZE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + tokens % PAGE_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    # An FP8 cache (--kv-cache-dtype fp8_e4m3) is widened in registers: every e4m3 value is exact in q's dtype.
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0).to(
        q.dtype
    )
    if IEEE_FP32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    visible = valid[None, :]
    if CAUSAL:
        visible = visible & (tokens[None, :] <= row_pos[:, None])
    if WINDOWED:
        visible = visible & (tokens[None, :] > row_pos[:, None] - window)
    qk = qk * qk_scale  # qk_scale includes log2(e): softmax in exp2
    if SOFTCAPPED:  # the cap applies to the natural-log score: out of exp2's domain and back
        qk = softcap_scores(qk * 0.6931471805599453, softcap) * 1.4426950408889634
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no key yet (a sliding window's first tiles) keeps m = -inf: exponentiate
    # against 0 then, so its empty tile adds 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0).to(
        q.dtype
    )
    if IEEE_FP32:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# Integers that change from step to step are not specialised on (Triton would compile a variant per
# value class: 1, a multiple of 16, other). Cold, each variant is seconds of JIT in the middle of
# serving: offline 1,000 requests ran at 7,365-7,725 tok/s on a cold cache and 9,606 on a warm one.
# Nor are the metadata pointers' alignments: a mixed step passes views that start after its decode rows
# (seq_lens[31:] is 4 bytes past a 16-byte boundary), and the first such step JIT-compiled a variant
# in the middle of the offline run (1.1-1.3 s of one step on the H200). They are read a value at a time.
@triton.jit(
    do_not_specialize=["num_requests", "window", "stride_pb"],
    do_not_specialize_on_alignment=["query_start_ptr", "seq_lens_ptr", "page_table_ptr"],
)
def ragged_paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    page_table_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_requests,
    qk_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pb,
    stride_ot,
    stride_oh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    WINDOWED: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    SOFTCAPPED: tl.constexpr = False,
    KV_SCALED: tl.constexpr = False,
):
    # KV_SCALED: the cache holds k / k_scale and v / v_scale (per-tensor float32 scalars on the device,
    # checkpoint-calibrated; vLLM's k_scale / v_scale): k_scale folds into the score scale, v_scale
    # into the output, so the tiles are read as stored.
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_ptr, num_requests, block, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_begin
    first = (block - (q_begin // BLOCK_Q + request)) * BLOCK_Q  # this block's first token in the request
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    prefix = seq_len - q_len
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    token = first + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_mask = (token < q_len) & (offs_m % GROUP_PAD < GROUP)
    # Rows past the request's end take its last token's position: every row sees at least one
    # key (no all -inf row, no NaN), and they are never stored.
    row_pos = prefix + tl.minimum(token, q_len - 1)
    q = tl.load(
        q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    table_row_ptr = page_table_ptr + request * stride_pb
    last = prefix + tl.minimum(first + BLOCK_Q, q_len)  # one past the block's last position
    if WINDOWED:
        # From the first key the block's earliest row can see, every tile masked both ways.
        lowest = tl.maximum(prefix + first - window + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(lowest, last, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                qk_scale,
                start,
                last,
                row_pos,
                window,
                softcap,
                k_ptr,
                v_ptr,
                table_row_ptr,
                kv_head,
                stride_ks,
                stride_kh,
                stride_vs,
                stride_vh,
                offs_n,
                offs_d,
                d_mask,
                PAGE_SIZE,
                True,
                True,
                IEEE_FP32,
                SOFTCAPPED,
            )
    else:
        unmasked_end = (prefix + first) // BLOCK_N * BLOCK_N  # every row sees all of [0, unmasked_end)
        for start in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                qk_scale,
                start,
                unmasked_end,
                row_pos,
                window,
                softcap,
                k_ptr,
                v_ptr,
                table_row_ptr,
                kv_head,
                stride_ks,
                stride_kh,
                stride_vs,
                stride_vh,
                offs_n,
                offs_d,
                d_mask,
                PAGE_SIZE,
                False,
                False,
                IEEE_FP32,
                SOFTCAPPED,
            )
        for start in range(unmasked_end, last, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                qk_scale,
                start,
                last,
                row_pos,
                window,
                softcap,
                k_ptr,
                v_ptr,
                table_row_ptr,
                kv_head,
                stride_ks,
                stride_kh,
                stride_vs,
                stride_vh,
                offs_n,
                offs_d,
                d_mask,
                PAGE_SIZE,
                True,
                False,
                IEEE_FP32,
                SOFTCAPPED,
            )
    out = acc / l_i[:, None]
    if KV_SCALED:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + (q_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )
