import triton
import triton.language as tl


@triton.jit
def apply_penalties_kernel(
    logits_ptr,
    logits_stride,
    positions_ptr,
    rows_ptr,
    seen_ptr,
    counts_ptr,
    state_stride,
    repetition_ptr,
    frequency_ptr,
    presence_ptr,
    vocab,
    HAS_COUNTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """In place, for penalized request i and one vocabulary block: its logits row (positions[i]) with
    the repetition penalty where its decode row (rows[i]) has seen the token, then frequency and
    presence from that row's output counts. The state rows are read where they are: no gathered copy."""
    i = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < vocab
    position = tl.load(positions_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    pointers = logits_ptr + position * logits_stride + offsets
    x = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    repetition = tl.load(repetition_ptr + i)
    seen = tl.load(seen_ptr + row * state_stride + offsets, mask=mask, other=0)
    # div_rn: the IEEE division torch does, so a penalized token's logit is the same bits on both paths.
    penalized = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
    x = tl.where(seen != 0, penalized, x)
    if HAS_COUNTS:
        counts = tl.load(counts_ptr + row * state_stride + offsets, mask=mask, other=0).to(tl.float32)
        frequency = tl.load(frequency_ptr + i)
        presence = tl.load(presence_ptr + i)
        x = x - frequency * counts - presence * (counts > 0).to(tl.float32)
    tl.store(pointers, x.to(logits_ptr.dtype.element_ty), mask=mask)
