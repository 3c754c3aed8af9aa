import triton
import triton.language as tl


@triton.jit
def fp8_weight_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_scale,
    HAS_BIAS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out[M, N] = x[M, K] @ (w[N, K] * scale).T (+ bias): FP8 weights, activations in their own dtype.

    Each weight tile is read once from memory as 1 byte per weight and widened to the activations'
    dtype in registers (every e4m3 value is exact in bf16/fp16), so at decode batch sizes the matmul
    costs the FP8 bytes, not bf16's. The scale is per output channel (SCALE_BLOCK 0: scale[N]) or
    per 128 x 128 block (SCALE_BLOCK 128: scale[N / 128, K / 128], stride_scale its row stride), the
    block scale applied to each K tile's partial product before it is accumulated.

    SPLIT_K > 1: program (n, m, s) sums the s-th of SPLIT_K ranges of K and adds its float32 partial
    into out (which the caller zeroed) with an atomic add; the caller then casts. For a small batch
    and a tall, narrow matrix that gives every SM programs to run."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_idx = k0 + rk
        k_mask = k_idx < k_end
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k_idx[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k_idx[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        partial = tl.dot(x, w.to(x.dtype))
        if SCALE_BLOCK > 0:
            block_scale = tl.load(
                scale_ptr + (rn // SCALE_BLOCK) * stride_scale + k0 // SCALE_BLOCK, mask=n_mask, other=0.0
            )
            acc += partial * block_scale[None, :]
        else:
            acc += partial
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS and pid_k == 0:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Row m of x to e4m3 with its own scale (max |x| / FP8_MAX, at least 1e-12): one launch for the
    whole batch instead of torch's abs / amax / divide / clamp / cast (five kernels, ~4 us each)."""
    m = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_K)
    absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_xm + k0 + offsets, mask=k0 + offsets < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.maximum(tl.max(absmax, axis=0) / FP8_MAX, 1e-12)
    tl.store(scale_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offsets < K
        x = tl.load(x_ptr + m * stride_xm + k0 + offsets, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + m * stride_om + k0 + offsets, q.to(out_ptr.dtype.element_ty), mask=mask)
