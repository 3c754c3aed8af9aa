import triton
import triton.language as tl


@triton.jit
def chunk_topk_kernel(logits_ptr, logits_stride, out_ptr, vocab, num_chunks, K: tl.constexpr, CHUNK: tl.constexpr):
    """The K best of one chunk of one row, as int64 keys that carry value and index together:
    (order-preserving int32 of the float32 value) << 32 | column. out[row, chunk, :K], best first."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + columns, mask=columns < vocab, other=float("-inf"))
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flipping their magnitude bits makes int order = float order.
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = (ordered.to(tl.int64) << 32) | columns.to(tl.int64)
    best = tl.topk(keys, K)
    tl.store(out_ptr + (row.to(tl.int64) * num_chunks + chunk) * K + tl.arange(0, K), best)
