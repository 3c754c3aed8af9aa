"""Moving whole KV pages between the device pool's per-layer tensors and a staging buffer (the host tier's copies).

The pool's k and v of every layer are separate tensors; their base addresses come in as one int64 table, so one
launch gathers (or scatters) the pages of all of them. A program moves one block of one page of one tensor, in
words (int32, or bytes where a page is not a whole number of words).
"""

import triton
import triton.language as tl


@triton.jit
def kv_pages_kernel(
    table_ptr,  # int64 [tensors]: each pool tensor's base address
    pages_ptr,  # int64 [pages]: the pool pages to move
    staging_ptr,  # [pages, tensors, words_per_page]
    words_per_page,
    num_tensors,
    TO_STAGING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    tensor = tl.program_id(1)
    offsets = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < words_per_page
    page = tl.load(pages_ptr + i)
    base = tl.load(table_ptr + tensor).to(tl.pointer_type(staging_ptr.dtype.element_ty))
    pool_row = base + page * words_per_page
    staged_row = staging_ptr + (i.to(tl.int64) * num_tensors + tensor) * words_per_page
    if TO_STAGING:
        tl.store(staged_row + offsets, tl.load(pool_row + offsets, mask=mask), mask=mask)
    else:
        tl.store(pool_row + offsets, tl.load(staged_row + offsets, mask=mask), mask=mask)
