"""The Triton attention kernels against the torch reference (engine.layers.torch_attention).

On a GPU the kernels run compiled, over the full matrix (contexts up to 8k,
64-request ragged batches, bf16); without one they run in Triton's CPU
interpreter over a smaller matrix in float32, so the same kernel source is
checked on every CI machine. Every cache slot no request owns holds NaN:
a kernel that reads past a request's pages poisons its output.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from triton_interpreter import interpreter_mode

from engine.layers.attention import AttentionMetadata
from engine.layers.torch_attention import extend_attention

# CUDA or ROCm: HIP devices are torch "cuda" devices, and Triton compiles the kernels for both.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def kernel_mode():
    return nullcontext() if ON_GPU else interpreter_mode()


@dataclass
class RaggedCase:
    q: torch.Tensor  # [tokens, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, pages] int32
    seq_lens: list[int]
    query_lens: list[int]
    page_size: int

    @property
    def query_start_loc(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    def reference(self, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """extend_attention in float32 (per request SDPA with a causal mask behind the prefix)."""
        meta = AttentionMetadata(
            is_decode=False,
            slot_indices=torch.empty(0),
            page_table=self.page_table,
            seq_lens=torch.tensor(self.seq_lens),
            page_size=self.page_size,
            query_start_loc=self.query_start_loc,
            seq_lens_cpu=self.seq_lens,
        )
        return extend_attention(
            self.q.float(), self.k_cache.float(), self.v_cache.float(), meta, self.q.shape[-1] ** -0.5, window, softcap
        )


def ragged_case(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    query_lens: list[int],
    prefixes: list[int],
    dtype: torch.dtype,
    seed: int = 0,
) -> RaggedCase:
    """Scattered pages (a shuffled pool, page 0 never used) and NaN in every slot no request owns."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefixes, query_lens)]
    pages_each = [-(-s // page_size) for s in seq_lens]
    total_pages = sum(pages_each) + 3  # spare pages stay NaN
    order = (torch.randperm(total_pages - 1, generator=generator) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages_each), dtype=torch.int32)
    k_cache = torch.full((total_pages * page_size, kv_heads, head_dim), float("nan"), dtype=torch.float32)
    v_cache = k_cache.clone()
    cursor = 0
    for row, (length, count) in enumerate(zip(seq_lens, pages_each)):
        table[row, :count] = torch.tensor(order[cursor : cursor + count], dtype=torch.int32)
        cursor += count
        # Only the slots the request's tokens own get values.
        positions = torch.arange(length)
        slots = table[row, positions // page_size].long() * page_size + positions % page_size
        k_cache[slots] = torch.randn(length, kv_heads, head_dim, generator=generator)
        v_cache[slots] = torch.randn(length, kv_heads, head_dim, generator=generator)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator)
    to = dict(device=DEVICE, dtype=dtype)
    return RaggedCase(q.to(**to), k_cache.to(**to), v_cache.to(**to), table.to(DEVICE), seq_lens, query_lens, page_size)


def tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


def run_ragged(case: RaggedCase, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    from backends.cuda.triton_extend import ragged_paged_attention

    starts = torch.tensor(case.query_start_loc, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
    return ragged_paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        starts,
        lens,
        case.page_table,
        case.page_size,
        case.q.shape[-1] ** -0.5,
        window,
        softcap,
    )


def random_batch(rng: random.Random, requests: int, max_context: int) -> tuple[list[int], list[int]]:
    """Ragged query lengths and prefixes: some without a prefix, some one-token (decode-like)."""
    query_lens, prefixes = [], []
    for _ in range(requests):
        context = rng.randint(1, max_context)
        kind = rng.random()
        new = context if kind < 0.3 else (1 if kind < 0.5 else rng.randint(1, context))
        query_lens.append(new)
        prefixes.append(context - new)
    return query_lens, prefixes


CPU_CASES = [  # (heads, kv_heads, head_dim, page_size, query_lens, prefixes)
    (4, 4, 64, 16, [37], [0]),  # MHA, no prefix, several query blocks
    (8, 2, 64, 1, [5, 40, 1], [0, 20, 33]),  # GQA 4, page size 1, a decode-like row
    (8, 1, 64, 64, [70, 3], [130, 0]),  # GQA 8, page size 64, a long prefix
    (4, 4, 128, 16, [17, 1, 33], [16, 200, 0]),  # head dim 128
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size,query_lens,prefixes", CPU_CASES)
def test_ragged_attention_matches_reference(heads, kv_heads, head_dim, page_size, query_lens, prefixes) -> None:
    dtype = torch.float32
    with kernel_mode():
        case = ragged_case(heads, kv_heads, head_dim, page_size, query_lens, prefixes, dtype)
        got = run_ragged(case)
    want = case.reference()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


# Each (dtype, head dim, group, page size) is its own compiled kernel (~5 s to build): every GQA ratio
# and page size at head dim 128 in bf16, and the other head dim and float32 over a subset.
GPU_MATRIX = [(torch.bfloat16, 128, group, page) for group in (1, 4, 8) for page in (1, 16, 64)] + [
    (torch.bfloat16, 64, 4, 16),
    (torch.bfloat16, 64, 1, 64),
    (torch.float32, 128, 4, 16),
    (torch.float32, 64, 8, 1),
]


@pytest.mark.cuda  # the full matrix runs compiled on a GPU
@pytest.mark.rocm
@pytest.mark.parametrize("dtype,head_dim,group,page_size", GPU_MATRIX)
def test_ragged_attention_full_matrix(dtype: torch.dtype, head_dim: int, group: int, page_size: int) -> None:
    rng = random.Random(head_dim * 100 + group * 10 + page_size)
    for requests, max_context in ((1, 8192), (7, 2048), (64, 300)):
        query_lens, prefixes = random_batch(rng, requests, max_context)
        kv_heads = 8 if group < 8 else 4
        case = ragged_case(kv_heads * group, kv_heads, head_dim, page_size, query_lens, prefixes, dtype, seed=requests)
        got = run_ragged(case)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), case.reference(), atol=tolerance(dtype), rtol=tolerance(dtype))


def decode_case(
    heads: int, kv_heads: int, head_dim: int, page_size: int, seq_lens: list[int], dtype: torch.dtype
) -> RaggedCase:
    """One query token per request at the end of its context."""
    return ragged_case(heads, kv_heads, head_dim, page_size, [1] * len(seq_lens), [s - 1 for s in seq_lens], dtype)


def run_decode(case: RaggedCase, splits: int | None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    from backends.cuda.triton_decode import paged_decode_attention_triton

    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
    return paged_decode_attention_triton(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        lens,
        case.page_size,
        case.q.shape[-1] ** -0.5,
        splits=splits,
        window=window,
        softcap=softcap,
    )


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_kernel_split_k(splits: int, page_size: int) -> None:
    """Split-K must equal one pass, including splits past the end of short contexts (seq_len 1)."""
    dtype = torch.float32
    with kernel_mode():
        case = decode_case(8, 2, 64, page_size, [1, 17, 64, 150], dtype)
        got = run_decode(case, splits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), case.reference().cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.cuda  # long contexts run compiled on a GPU
@pytest.mark.rocm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_kernel_long_context(dtype: torch.dtype, batch: int) -> None:
    rng = random.Random(batch)
    case = decode_case(32, 8, 128, 16, [rng.randint(1, 8192) for _ in range(batch)], dtype)
    for splits in (None, 1):
        got = run_decode(case, splits)
        torch.testing.assert_close(got.float(), case.reference(), atol=tolerance(dtype), rtol=tolerance(dtype))


def test_mixed_step_through_backend() -> None:
    """The backend's mixed path: decode rows (decode kernel, which stores their k/v) first, then ragged
    extends (stored by the backend), one output. Every new token's slot holds NaN before the call, so a
    kernel that reads one before it is stored, or a row that is never stored, poisons the result."""
    from backends.cuda.triton_attention import TritonAttentionBackend

    dtype = torch.float32
    with kernel_mode():
        case = ragged_case(8, 2, 64, 16, [1, 1, 20, 7], [30, 5, 0, 40], dtype)
        reference = case.reference().cpu()
        starts = case.query_start_loc
        slots = torch.cat(
            [
                case.page_table[row, positions // case.page_size].long() * case.page_size + positions % case.page_size
                for row, positions in enumerate(
                    torch.arange(length - n, length, device=DEVICE) for length, n in zip(case.seq_lens, case.query_lens)
                )
            ]
        )
        k_new, v_new = case.k_cache[slots].clone(), case.v_cache[slots].clone()
        case.k_cache[slots] = float("nan")
        case.v_cache[slots] = float("nan")
        meta = AttentionMetadata(
            is_decode=False,
            slot_indices=slots,
            page_table=case.page_table,
            seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE),
            page_size=case.page_size,
            query_start_loc=starts,
            seq_lens_cpu=case.seq_lens,
            query_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            num_decodes=2,
        )
        got = TritonAttentionBackend().forward(case.q, k_new, v_new, case.k_cache, case.v_cache, meta, 64**-0.5)
    torch.testing.assert_close(got.float().cpu(), reference, atol=tolerance(dtype), rtol=tolerance(dtype))
    torch.testing.assert_close(case.k_cache[slots], k_new)  # every new row stored, decode and extend alike
    torch.testing.assert_close(case.v_cache[slots], v_new)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window_in_both_kernels(window: int) -> None:
    """Each query sees its last `window` positions: ragged batches (prefixes longer and shorter than
    the window, chunks straddling it) and split-K decode, against the torch reference."""
    dtype = torch.float32
    with kernel_mode():
        case = ragged_case(8, 2, 64, 16, [37, 5, 1, 60], [0, 90, 20, 3], dtype)
        got = run_ragged(case, window)
        decode = decode_case(8, 2, 64, 16, [1, 17, 64, 150], dtype)
        got_decode = [run_decode(decode, splits, window) for splits in (1, 4)]
    assert torch.isfinite(got).all()
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float().cpu(), case.reference(window).cpu(), atol=tol, rtol=tol)
    for out in got_decode:
        torch.testing.assert_close(out.float().cpu(), decode.reference(window).cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 7])
def test_soft_capped_scores_in_both_kernels(window: int) -> None:
    """Gemma 2's softcap * tanh(score / softcap), alone and with a sliding window, against the torch
    reference; the cap (5) is below the scores' spread here, so an uncapped kernel fails this."""
    dtype = torch.float32
    softcap = 5.0
    with kernel_mode():
        case = ragged_case(8, 2, 64, 16, [37, 5, 1, 60], [0, 90, 20, 3], dtype)
        case.q.mul_(4.0)  # scores well past the cap
        got = run_ragged(case, window, softcap)
        decode = decode_case(8, 2, 64, 16, [1, 17, 64, 150], dtype)
        decode.q.mul_(4.0)
        got_decode = [run_decode(decode, splits, window, softcap) for splits in (1, 4)]
    tol = tolerance(dtype)
    want = case.reference(window, softcap).cpu()
    assert not torch.allclose(case.reference(window).cpu(), want, atol=1e-2)  # the cap matters here
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    for out in got_decode:
        torch.testing.assert_close(out.float().cpu(), decode.reference(window, softcap).cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_fp8_kv_cache_is_widened_exactly(kind: str) -> None:
    """--kv-cache-dtype fp8_e4m3: the kernels read e4m3 caches (NaN where no request owns a slot, as
    above) and equal the reference over the same caches widened to float32."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    with kernel_mode():
        if kind == "decode":
            case = decode_case(8, 2, 64, 16, [1, 17, 64, 150], dtype)
        else:
            case = ragged_case(8, 2, 64, 16, [5, 40, 1], [0, 20, 33], dtype)
        case.k_cache = case.k_cache.to(torch.float8_e4m3fn)
        case.v_cache = case.v_cache.to(torch.float8_e4m3fn)
        got = run_decode(case, None) if kind == "decode" else run_ragged(case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), case.reference().cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


def last_slots(case: RaggedCase) -> torch.Tensor:
    """Each decode row's slot of its last position (the new token's)."""
    last = torch.tensor(case.seq_lens, device=DEVICE) - 1
    pages = case.page_table.gather(1, (last // case.page_size).unsqueeze(1).to(case.page_table.device)).squeeze(1)
    return pages.long() * case.page_size + last % case.page_size


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("fp8,k_scale,v_scale", [(False, None, None), (True, None, None), (True, 4.0, 0.5)])
def test_decode_kernel_stores_the_new_rows_itself(
    splits: int, window: int, fp8: bool, k_scale: float | None, v_scale: float | None
) -> None:
    """new_kv: the kernel writes this step's k/v to their slots and attends to them, which must equal
    storing first (torch) and attending over the cache: the same output and the same cache. The new
    rows' slots hold NaN before the launch, so a program that reads them from the cache poisons its
    output; an FP8 cache gets them saturated (one value past e4m3's range). The FP8 case goes through
    the op (triton_paged_decode): compiled on a GPU that is the kernel's own e4m3 store; in Triton's
    interpreter, which narrows float32 to e4m3 wrongly, the op stores with torch first, and that
    fallback is what runs here. With scales the stored rows are k / k_scale, v / v_scale: on a GPU
    the kernel's division must equal torch's bit for bit. The new rows are strided views of a fused
    projection, as the Llama attention passes them to this backend."""
    from backends.cuda.triton_attention import store_kv_rows, triton_paged_decode
    from backends.cuda.triton_decode import paged_decode_attention_triton

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    with kernel_mode():
        case = decode_case(8, 2, 64, 16, [1, 17, 64, 150], dtype)
        if fp8:
            case.k_cache, case.v_cache = case.k_cache.to(torch.float8_e4m3fn), case.v_cache.to(torch.float8_e4m3fn)
        slots = last_slots(case)
        generator = torch.Generator().manual_seed(7)
        # Strided views of one fused projection, as the model passes them (capabilities.strided_kv): rows 384 apart.
        fused = torch.randn(4, 3 * 128, generator=generator).to(DEVICE, dtype)
        k_new, v_new = fused[:, 128:256].view(4, 2, 64), fused[:, 256:].view(4, 2, 64)
        assert not k_new.is_contiguous() and not v_new.is_contiguous()
        k_new[3, 1, 5] = 1000.0  # past e4m3's 448: saturated, not NaN
        scales = {}
        if k_scale is not None:
            scales = dict(k_scale=torch.tensor(k_scale, device=DEVICE), v_scale=torch.tensor(v_scale, device=DEVICE))
        stored_k, stored_v = case.k_cache.clone(), case.v_cache.clone()
        store_kv_rows(stored_k, slots, k_new, scales.get("k_scale"))
        store_kv_rows(stored_v, slots, v_new, scales.get("v_scale"))
        case.k_cache[slots] = float("nan")
        case.v_cache[slots] = float("nan")
        lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
        if fp8:
            got = triton_paged_decode(
                case.q,
                k_new,
                v_new,
                case.k_cache,
                case.v_cache,
                slots,
                case.page_table,
                lens,
                case.page_size,
                64**-0.5,
                window,
                **scales,
            )
        else:
            got = paged_decode_attention_triton(
                case.q,
                case.k_cache,
                case.v_cache,
                case.page_table,
                lens,
                case.page_size,
                64**-0.5,
                splits=splits,
                window=window,
                new_kv=(k_new, v_new, slots),
            )
        want = paged_decode_attention_triton(
            case.q,
            stored_k,
            stored_v,
            case.page_table,
            lens,
            case.page_size,
            64**-0.5,
            splits=None if fp8 else splits,
            window=window,
            **scales,
        )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))
    assert torch.equal(case.k_cache[slots].float().cpu(), stored_k[slots].float().cpu())
    assert torch.equal(case.v_cache[slots].float().cpu(), stored_v[slots].float().cpu())


def e4m3_scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache with per-tensor `scale` hands back for x: e4m3(x / scale) * scale, saturated."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def scaled_fp8_case(kind: str, page_size: int, k_scale: float, v_scale: float) -> tuple[RaggedCase, RaggedCase]:
    """(an FP8 case whose caches hold k / k_scale and v / v_scale, its float32 twin holding what they
    stand for: e4m3(k / k_scale) * k_scale). K/V span +-k_scale * 448 (past e4m3's range at unit scale)."""
    if kind == "decode":
        case = decode_case(8, 2, 64, page_size, [1, 17, 64, 150], torch.float32)
    else:
        case = ragged_case(8, 2, 64, page_size, [5, 40, 1], [0, 20, 33], torch.float32)
    k_full, v_full = case.k_cache * (k_scale * 100), case.v_cache * (v_scale * 100)  # randn x 100: tails past 448
    twin = RaggedCase(
        case.q / (k_scale * 10),
        e4m3_scaled(k_full, k_scale),
        e4m3_scaled(v_full, v_scale),
        case.page_table,
        case.seq_lens,
        case.query_lens,
        page_size,
    )
    case.q = twin.q
    case.k_cache = (k_full / k_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    case.v_cache = (v_full / v_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return case, twin


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_fp8_kv_scales_fold_into_attention(kind: str, page_size: int) -> None:
    """A cache holding k / k_scale and v / v_scale (checkpoint-calibrated scales): both kernels, given the
    scales as device scalars, equal float attention over e4m3(k / k_scale) * k_scale (and v alike).
    Without the scales the same launch is far off (the test can fail)."""
    k_scale, v_scale = torch.tensor(2.5), torch.tensor(0.75)
    with kernel_mode():
        case, twin = scaled_fp8_case(kind, page_size, float(k_scale), float(v_scale))
        scales = dict(k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE))
        if kind == "decode":
            got = [run_decode_scaled(case, splits, **scales) for splits in (1, 4)]
            unscaled = run_decode(case, None)
        else:
            got = [run_ragged_scaled(case, **scales)]
            unscaled = run_ragged(case)
    want = twin.reference().cpu()
    for out in got:
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float().cpu(), want, atol=2e-3, rtol=2e-3)
    assert not torch.allclose(unscaled.float().cpu(), want, atol=0.1)


def run_decode_scaled(
    case: RaggedCase, splits: int | None, k_scale: torch.Tensor, v_scale: torch.Tensor
) -> torch.Tensor:
    from backends.cuda.triton_decode import paged_decode_attention_triton

    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
    return paged_decode_attention_triton(
        case.q,
        case.k_cache,
        case.v_cache,
        case.page_table,
        lens,
        case.page_size,
        case.q.shape[-1] ** -0.5,
        splits=splits,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def run_ragged_scaled(case: RaggedCase, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    from backends.cuda.triton_extend import ragged_paged_attention

    starts = torch.tensor(case.query_start_loc, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE)
    return ragged_paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        starts,
        lens,
        case.page_table,
        case.page_size,
        case.q.shape[-1] ** -0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scaled", [True, False])
def test_fp8_kv_scale_keeps_values_past_448(page_size: int, scaled: bool) -> None:
    """A mixed step through the backend (decode rows stored by the decode op, extend rows by
    store_kv_rows) with k/v reaching +-2000: with k_scale 8 and v_scale 6 the FP8 cache keeps them
    (stored / scale, read back * scale) and attention equals the float reference over
    e4m3(x / s) * s. At unit scale (the case scaled=False, today's behaviour before scales) they
    saturate at 448 and the same comparison must fail."""
    from backends.cuda.triton_attention import TritonAttentionBackend

    k_scale, v_scale = 8.0, 6.0
    with kernel_mode():
        case = ragged_case(8, 2, 64, page_size, [1, 1, 20, 7], [30, 5, 0, 40], torch.float32)
        starts = case.query_start_loc
        slots = torch.cat(
            [
                case.page_table[row, positions // case.page_size].long() * case.page_size + positions % case.page_size
                for row, positions in enumerate(
                    torch.arange(length - n, length, device=DEVICE) for length, n in zip(case.seq_lens, case.query_lens)
                )
            ]
        )
        k_full, v_full = case.k_cache * 500.0, case.v_cache * 500.0  # randn x 500: many values past 448 * 2
        k_full[slots[0], 0, 0], v_full[slots[-1], 1, 3] = 2000.0, -2000.0  # a decode row's and an extend row's
        k_new, v_new = k_full[slots].clone(), v_full[slots].clone()
        k_cache = (k_full / k_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        v_cache = (v_full / v_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        twin = RaggedCase(
            case.q / 100.0,
            e4m3_scaled(k_full, k_scale),
            e4m3_scaled(v_full, v_scale),
            case.page_table,
            case.seq_lens,
            case.query_lens,
            page_size,
        )
        meta = AttentionMetadata(
            is_decode=False,
            slot_indices=slots,
            page_table=case.page_table,
            seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE),
            page_size=page_size,
            query_start_loc=starts,
            seq_lens_cpu=case.seq_lens,
            query_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            num_decodes=2,
        )
        scales = dict(k_scale=torch.tensor(k_scale, device=DEVICE), v_scale=torch.tensor(v_scale, device=DEVICE))
        got = TritonAttentionBackend().forward(
            twin.q, k_new, v_new, k_cache, v_cache, meta, 64**-0.5, **(scales if scaled else {})
        )
    stored_k, stored_v = k_cache[slots].float().cpu(), v_cache[slots].float().cpu()
    close = torch.allclose(got.float().cpu(), twin.reference().cpu(), atol=2e-3, rtol=2e-3)
    if scaled:
        assert close
        assert torch.equal(stored_k * k_scale, e4m3_scaled(k_new, k_scale).cpu())
        assert torch.equal(stored_v * v_scale, e4m3_scaled(v_new, v_scale).cpu())
        assert (stored_k * k_scale).abs().max() == 2048.0  # e4m3's nearest to 2000 / 8 = 250 is 256
    else:
        assert not close
        assert stored_k.abs().max() == 448.0  # saturated


@pytest.mark.parametrize("path", ["decode", "extend", "compiled_decode_op", "compiled_extend_op"])
def test_attention_layer_hands_its_kv_scales_to_the_backend(path: str) -> None:
    """The Attention layer's loaded scales reach the Triton kernels on every path a step takes: the
    decode op, the eager extend, and engine::step_attention (the compiled steps' opaque op) at decode and extend.
    k/v reach +-2000, so a path that dropped the scales saturates them and fails the comparison."""
    from backends.cuda.triton_attention import TritonAttentionBackend
    from engine.layers.attention import Attention
    from graphs.opaque_attention import attention_context

    k_scale, v_scale = 8.0, 6.0
    with kernel_mode():
        if path in ("decode", "compiled_decode_op"):
            case = decode_case(8, 2, 64, 16, [3, 17, 40], torch.float32)
        else:
            case = ragged_case(8, 2, 64, 16, [9, 1, 20], [0, 12, 5], torch.float32)
        slots = torch.cat(
            [
                case.page_table[row, positions // case.page_size].long() * case.page_size + positions % case.page_size
                for row, positions in enumerate(
                    torch.arange(length - n, length, device=DEVICE) for length, n in zip(case.seq_lens, case.query_lens)
                )
            ]
        )
        k_full, v_full = case.k_cache * 500.0, case.v_cache * 500.0
        k_new, v_new = k_full[slots].clone(), v_full[slots].clone()
        k_cache = (k_full / k_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        v_cache = (v_full / v_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        twin = RaggedCase(
            case.q / 100.0,
            e4m3_scaled(k_full, k_scale),
            e4m3_scaled(v_full, v_scale),
            case.page_table,
            case.seq_lens,
            case.query_lens,
            case.page_size,
        )
        starts = case.query_start_loc
        meta = AttentionMetadata(
            is_decode=path in ("decode", "compiled_decode_op"),
            slot_indices=slots,
            page_table=case.page_table,
            seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE),
            page_size=case.page_size,
            query_start_loc=starts,
            seq_lens_cpu=case.seq_lens,
            query_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        )
        layer = Attention(8, 2, 64)
        layer.backend = TritonAttentionBackend()
        layer.set_kv_scales(k_scale, v_scale, torch.device(DEVICE))
        # The compiled steps' way: the layer gets the metadata marked opaque, the op finds the step's own.
        with attention_context(layer.backend, meta) if path.startswith("compiled") else nullcontext(meta) as layer_meta:
            assert layer_meta.opaque_attention == path.startswith("compiled")
            got = layer(twin.q, k_new, v_new, (k_cache, v_cache), layer_meta)
    torch.testing.assert_close(got.float().cpu(), twin.reference().cpu(), atol=2e-3, rtol=2e-3)
