"""Triton source of the one-row matmul (imported only through backends.cuda.gemv).

A decode step at batch 1 multiplies one activation row by every weight matrix: pure weight streaming.
Each program owns BLOCK_N output rows and walks K in BLOCK_K chunks, multiplying in float32 into a
[BLOCK_N, BLOCK_K] accumulator that is reduced once at the end (a cross-thread reduction per chunk
would cost more than the loads). No split-K, so no second kernel and no atomics: narrow tiles give
every SM several programs instead. Weights in bf16/fp16/fp32, or e4m3 with a float32 scale per
output row (FP8 weight-only: the bytes are widened in registers). zero_rows rows after the computed
one are padding and get zeros (a batch-1 graph captured over two rows: engine/layers/live_rows.py).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "K", "zero_rows"])
def gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    zero_rows,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k0 + offs_k)
            if EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = k0 + offs_k < K
            x = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out = out * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)
    # Padding rows after the one computed (engine/layers/live_rows.py): zeros, so they stay finite. A run-time
    # count (not a constexpr, not specialised): one compiled variant serves batch 1 with and without them.
    for row in range(1, zero_rows + 1):
        tl.store(out_ptr + row * N + offs_n, tl.zeros([BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=n_mask)
