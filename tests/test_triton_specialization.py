"""The ragged attention kernel compiles one variant whatever a mixed step's decode-row count.

A mixed step hands the kernel views that start after its decode rows (seq_lens[decodes:],
page_table[decodes:]). Triton specialises a pointer argument on 16-byte alignment, so 31 decode rows
(seq_lens 124 bytes in) used to select a variant that no earlier step had compiled: a JIT of 1.1-1.3 s
in the middle of the H200's offline run. Triton's own argument binder, for an H100-class target, runs
here without a GPU: it must give every decode-row count the same specialization."""

from __future__ import annotations

import pytest
import torch


def _specialization(decodes: int, max_pages: int) -> tuple:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from backends.cuda.kernels.ragged_attention import ragged_paged_attention_kernel as kernel

    if not isinstance(kernel, JITFunction):  # TRITON_INTERPRET (the test suite): the decorator's own arguments
        kernel = JITFunction(kernel.fn, **kernel.kwargs)

    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32)))
    rows, heads, kv_heads, dim = 64, 8, 2, 64
    q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)[decodes:]
    cache = torch.zeros(32, kv_heads, dim, dtype=torch.bfloat16)
    query_starts = torch.zeros(rows, dtype=torch.int32)[decodes:] - decodes  # a new tensor, as in the backend
    seq_lens = torch.zeros(rows, dtype=torch.int32)[decodes:]
    page_table = torch.zeros(rows, max_pages, dtype=torch.int32)[decodes:]
    args = [
        q,
        cache,
        cache,
        q,
        query_starts,
        seq_lens,
        page_table,
        q,
        q,
        3,
        0.1,
        0,
        0.0,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(0),
        cache.stride(1),
        page_table.stride(0),
        q.stride(0),
        q.stride(1),
    ]
    _, specialization, _ = binder(
        *args,
        PAGE_SIZE=16,
        GROUP=4,
        GROUP_PAD=4,
        BLOCK_Q=16,
        BLOCK_N=32,
        HEAD_DIM=dim,
        DIM_PAD=dim,
        WINDOWED=False,
        IEEE_FP32=False,
    )
    return tuple(specialization)


@pytest.mark.parametrize("max_pages", [8, 13])
def test_ragged_kernel_variant_does_not_depend_on_decode_rows(max_pages: int) -> None:
    first = _specialization(0, max_pages)  # triton is a dependency (setup.cfg); its NVIDIA backend ships in the wheel
    for decodes in range(1, 33):
        assert _specialization(decodes, max_pages) == first, f"{decodes} decode rows select another kernel variant"
