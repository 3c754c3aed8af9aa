"""The CPU's native kernels (backends/cpu/kernels/*.c) against torch references.

No skips: gcc is already a requirement of the CPU graph path (inductor compiles C++ with it), so
the kernels must build wherever the tests run. Every test runs twice: with this CPU's fast paths, and with
them all switched off (`cpu_fast_paths_off`: no native kernels, no oneDNN packing, no CPU features), where
the same assertions hold the torch fallbacks a bare CPU takes. Which paths exist is asked exactly as the
engine asks (backends/cpu/features.py): the bf16
GEMV where the CPU has AVX512-BF16, oneDNN bf16 packing where it has AVX512BW/VL/DQ or
AVX-NE-CONVERT; the linear tests go through the engine's op, so they check whichever path runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backends.cpu import attention as cpu_attention
from backends.cpu.attention import (
    CpuAttentionBackend,
    bf16_prefill_cpu,
    choose_prefill_attention,
    cpu_paged_decode,
    native_decode_available,
    native_decode_supported,
)
from backends.cpu.features import native_gemv_bf16_supported
from backends.cpu.native import load, native_kernels_enabled
from backends.cpu.packed_linear import (
    _PACKED_ATTR,
    _gemv_kernel,
    native_gemv_bf16,
    onednn_packing_supported,
    pack_linear_weights,
)
from engine.errors import EngineError
from engine.layers.attention import AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.torch_attention import TorchAttentionBackend, paged_decode_attention


@pytest.fixture(autouse=True, params=["fast-paths-on", "fast-paths-off"])
def fast_paths(request: pytest.FixtureRequest) -> None:
    if request.param == "fast-paths-off":
        request.getfixturevalue("cpu_fast_paths_off")


def test_the_kernels_build_here() -> None:
    assert (load("paged_decode") is not None) == native_kernels_enabled()
    assert (_gemv_kernel() is not None) == (native_kernels_enabled() and native_gemv_bf16_supported())
    assert (cpu_attention._prefill_kernel() is not None) == (native_kernels_enabled() and bf16_prefill_cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_guards_itself(dtype: torch.dtype) -> None:
    """pack_linear_weights packs only what this CPU can run, switching those layers' linear method;
    the rest keeps the dense method and gives the same result."""
    layer = Linear(64, 32, bias=True).to(dtype)
    plain = nn.Linear(64, 32, dtype=dtype)  # not an engine Linear (an MoE router): never packed
    pack_linear_weights(nn.Sequential(layer, plain), batch_hint=4)
    assert hasattr(layer.weight, _PACKED_ATTR) == onednn_packing_supported(dtype)
    assert layer.method.name == ("onednn_packed" if onednn_packing_supported(dtype) else "dense")
    assert not hasattr(plain.weight, _PACKED_ATTR)
    x = torch.randn(3, 64, dtype=dtype)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=2e-2, rtol=2e-2)


def random_paged_batch(seq_lens: list[int], page_size: int, kv_heads: int, dim: int, seed: int) -> dict[str, Any]:
    """Caches with every request's pages scattered over the pool (never page 0), and this step's k/v."""
    generator = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // page_size) for n in seq_lens))
    num_pages = 1 + sum(-(-n // page_size) for n in seq_lens) + 3
    pages = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
    page_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for row, length in enumerate(seq_lens):
        for column in range(-(-length // page_size)):
            page_table[row, column] = pages.pop()
    last = torch.tensor([max(n, 1) - 1 for n in seq_lens])
    slots = page_table[torch.arange(len(seq_lens)), last // page_size].long() * page_size + last % page_size
    slots = torch.where(torch.tensor(seq_lens) > 0, slots, torch.zeros_like(slots))  # padding rows write slot 0
    shape = (num_pages * page_size, kv_heads, dim)
    return dict(
        k_cache=torch.randn(shape, generator=generator),
        v_cache=torch.randn(shape, generator=generator),
        slot_indices=slots,
        page_table=page_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        k=torch.randn(len(seq_lens), kv_heads, dim, generator=generator),
        v=torch.randn(len(seq_lens), kv_heads, dim, generator=generator),
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "seq_lens,heads,kv_heads",
    [
        ([1], 4, 4),  # one token of context, no GQA
        ([37], 9, 3),  # SmolLM2's heads
        ([5, 200, 64, 1, 130], 8, 2),  # ragged batch, long enough to run on several threads
        ([300] * 16, 9, 3),
    ],
)
def test_native_paged_decode_matches_torch(seq_lens: list[int], heads: int, kv_heads: int, page_size: int) -> None:
    batch = random_paged_batch(seq_lens, page_size, kv_heads, 64, seed=len(seq_lens) + heads)
    q = torch.randn(len(seq_lens), heads, 64)
    supported = native_decode_supported(q, batch["k_cache"], batch["v_cache"], batch["page_table"], batch["seq_lens"])
    assert supported == native_decode_available()
    expected_caches = (batch["k_cache"].clone(), batch["v_cache"].clone())
    want = paged_decode_attention(
        q,
        batch["k"],
        batch["v"],
        *expected_caches,
        batch["slot_indices"],
        batch["page_table"],
        batch["seq_lens"],
        page_size,
        0.125,
    )
    got = cpu_paged_decode(
        q,
        batch["k"],
        batch["v"],
        batch["k_cache"],
        batch["v_cache"],
        batch["slot_indices"],
        batch["page_table"],
        batch["seq_lens"],
        page_size,
        0.125,
    )
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(batch["k_cache"], expected_caches[0])  # the step's k/v were stored the same way


def test_native_paged_decode_zero_length_rows_give_zeros() -> None:
    """Rows of a padded batch that the graph runner marks with length 0 must not read garbage."""
    batch = random_paged_batch([0, 20], 16, 2, 64, seed=3)
    q = torch.randn(2, 4, 64)
    out = cpu_paged_decode(
        q,
        batch["k"],
        batch["v"],
        batch["k_cache"],
        batch["v_cache"],
        batch["slot_indices"],
        batch["page_table"],
        batch["seq_lens"],
        16,
        0.125,
    )
    assert torch.equal(out[0], torch.zeros(4, 64)) and torch.isfinite(out[1]).all()


def test_what_the_kernel_cannot_read_falls_back_to_torch() -> None:
    batch = random_paged_batch([10, 30], 16, 2, 64, seed=4)
    q = torch.randn(2, 4, 64)
    args = (batch["page_table"], batch["seq_lens"])
    assert not native_decode_supported(q.bfloat16(), batch["k_cache"].bfloat16(), batch["v_cache"].bfloat16(), *args)
    assert not native_decode_supported(q, batch["k_cache"], batch["v_cache"].bfloat16(), *args)
    # A strided view of a bigger cache: the kernel would read the wrong rows, so torch runs it.
    wide_k = torch.randn(batch["k_cache"].shape[0], 4, 64)
    wide_v = torch.randn_like(wide_k)
    k_view, v_view = wide_k[:, ::2], wide_v[:, ::2]
    assert not native_decode_supported(q, k_view, v_view, *args)
    want = paged_decode_attention(
        q, batch["k"], batch["v"], k_view.clone(), v_view.clone(), batch["slot_indices"], *args, 16, 0.125
    )
    got = cpu_paged_decode(q, batch["k"], batch["v"], k_view, v_view, batch["slot_indices"], *args, 16, 0.125)
    torch.testing.assert_close(got, want)


def test_loading_the_kernels_leaves_subnormals_alone() -> None:
    """Linking with -ffast-math would turn on flush-to-zero for the whole process (crtfastmath.o)."""
    load("paged_decode")
    load("gemv_bf16")
    tiny = torch.tensor([1e-39]) * 1.0
    assert tiny.item() != 0.0


@pytest.mark.parametrize(
    "rows,n,k,with_bias", [(1, 960, 576, False), (3, 576, 1536, True), (4, 3072, 576, False), (1, 4, 32, True)]
)
def test_bf16_decode_linear_is_float32_math_rounded_once(rows: int, n: int, k: int, with_bias: bool) -> None:
    """engine::linear at decode batch sizes (the native GEMV where the CPU has AVX512-BF16) vs exact math."""
    generator = torch.Generator().manual_seed(rows * n)
    layer = Linear(k, n, bias=with_bias).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=generator) * 0.05)
        if with_bias:
            layer.bias.copy_(torch.randn(n, generator=generator))
    pack_linear_weights(layer, batch_hint=16)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    got = torch.ops.engine.linear(x, layer.weight, layer.bias)
    if _gemv_kernel() is not None:
        assert torch.equal(got, native_gemv_bf16(x, layer.weight, layer.bias))  # the native kernel ran
    exact = F.linear(x.float(), layer.weight.float(), layer.bias.float() if with_bias else None)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # Float32 accumulation in a different order than the exact sum: at most one bf16 rounding step apart.
    ulp = exact.abs().clamp_min(1e-30) * 2.0**-7
    assert ((got.float() - exact).abs() <= ulp + 1e-6).all()


def test_native_gemv_declines_shapes_it_does_not_handle() -> None:
    x = torch.randn(1, 40).bfloat16()
    assert native_gemv_bf16(x, torch.randn(8, 40).bfloat16(), None) is None  # k % 32 != 0
    assert native_gemv_bf16(torch.randn(1, 64).bfloat16(), torch.randn(6, 64).bfloat16(), None) is None  # n % 4 != 0


def test_smollm2_bfloat16_decode_with_native_kernels_tracks_float32_transformers(
    engine_cache: Callable[..., Any], smol_hf: tuple[Any, Any]
) -> None:
    """The bf16 engine (native GEMV at batch 1, native attention over a float32 cache) vs HF in float32."""
    from helpers import engine_logits

    engine = engine_cache(None, dtype="bfloat16", kv_cache_dtype="float32", max_num_seqs=1)
    model, tokenizer = smol_hf
    prompt = tokenizer("The capital of France is Paris. The capital of Italy is", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1].float()
    _, decode = engine_logits(engine, prompt[:-1], prompt[-1])  # the last prompt token fed as a decode step
    assert int(decode.argmax()) == int(want.argmax())
    assert F.cosine_similarity(decode.float(), want, dim=0) > 0.995


def extend_step(
    requests: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, page_size: int, seed: int
) -> dict[str, Any]:
    """An extend step over (cached prefix, new tokens) requests: caches holding every prefix on scattered pages,
    this step's q / k / v, and its metadata."""
    lengths = [prefix + new for prefix, new in requests]
    batch = random_paged_batch(lengths, page_size, kv_heads, dim, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    slots = []
    for row, (prefix, new) in enumerate(requests):
        positions = torch.arange(prefix, prefix + new)
        slots.append(batch["page_table"][row, positions // page_size].long() * page_size + positions % page_size)
    tokens = sum(new for _, new in requests)
    starts = [0]
    for _, new in requests:
        starts.append(starts[-1] + new)
    meta = AttentionMetadata(
        is_decode=False,
        slot_indices=torch.cat(slots),
        page_table=batch["page_table"],
        seq_lens=batch["seq_lens"],
        page_size=page_size,
        query_start_loc=starts,
        seq_lens_cpu=lengths,
    )
    return dict(
        q=torch.randn(tokens, heads, dim, generator=generator),
        k=torch.randn(tokens, kv_heads, dim, generator=generator),
        v=torch.randn(tokens, kv_heads, dim, generator=generator),
        k_cache=batch["k_cache"],
        v_cache=batch["v_cache"],
        meta=meta,
    )


@pytest.mark.parametrize(
    "requests,heads,kv_heads,dim,page_size",
    [
        ([(0, 300)], 9, 3, 64, 16),  # SmolLM2's heads, a prompt alone: keys read from this step's k / v
        ([(0, 33)], 4, 4, 64, 1),  # a partial query block and key tile, no GQA
        ([(100, 70)], 9, 3, 64, 16),  # a cached prefix: keys gathered from the pages
        ([(0, 64), (50, 129)], 8, 2, 128, 16),  # two requests, a wider head
    ],
)
def test_bf16_prefill_attention_is_as_close_to_exact_as_torchs_bf16(
    requests: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, page_size: int
) -> None:
    """The bf16 prefill kernel (kernels/prefill_attention_bf16.c) against float64 attention: within twice the
    error of torch's own bf16 SDPA (q, k, v rounded to bf16), and storing the step's k / v as the torch path
    does. Where the kernel is absent (fast paths off, no AVX512-BF16) the backend runs SDPA in float32."""
    step = extend_step(requests, heads, kv_heads, dim, page_size, seed=len(requests) + heads + dim)
    backend = CpuAttentionBackend()
    backend.bf16_prefill_rows = 1
    assert backend.bf16_prefill_applies(step["q"], step["meta"], 0, 0.0) == (
        cpu_attention._prefill_kernel() is not None
    )
    args = (step["meta"], 0.125)
    caches = (step["k_cache"].clone(), step["v_cache"].clone())
    got = backend.forward(step["q"], step["k"], step["v"], *caches, *args)

    def torch_attention(dtype: torch.dtype) -> torch.Tensor:
        plain = TorchAttentionBackend(dtype)
        q, k, v, k_cache, v_cache = (step[name].to(dtype) for name in ("q", "k", "v", "k_cache", "v_cache"))
        return plain.forward(q, k, v, k_cache, v_cache, step["meta"], 0.125).double()

    exact = torch_attention(torch.float64)
    error = (got.double() - exact).abs().max().item()
    torch_bf16_error = (torch_attention(torch.bfloat16) - exact).abs().max().item()
    assert error <= 2 * torch_bf16_error, f"{error:.4f} against torch bf16's {torch_bf16_error:.4f}"
    if cpu_attention._prefill_kernel() is None:
        assert error < 1e-5  # float32 SDPA
    torch.testing.assert_close(caches[0], step["k_cache"].index_copy(0, step["meta"].slot_indices, step["k"]))
    torch.testing.assert_close(caches[1], step["v_cache"].index_copy(0, step["meta"].slot_indices, step["v"]))


def test_bf16_prefill_attention_leaves_short_requests_windows_and_softcaps_to_sdpa() -> None:
    step = extend_step([(0, 40), (0, 300)], 9, 3, 64, 16, seed=5)
    backend = CpuAttentionBackend()
    assert not backend.bf16_prefill_applies(step["q"], step["meta"], 0, 0.0)  # not chosen
    backend.bf16_prefill_rows = 256
    assert not backend.bf16_prefill_applies(step["q"], step["meta"], 0, 0.0)  # a request of 40 new tokens
    backend.bf16_prefill_rows = 40
    available = cpu_attention._prefill_kernel() is not None
    assert backend.bf16_prefill_applies(step["q"], step["meta"], 0, 0.0) == available
    assert not backend.bf16_prefill_applies(step["q"], step["meta"], 128, 0.0)
    assert not backend.bf16_prefill_applies(step["q"], step["meta"], 0, 30.0)
    assert not backend.bf16_prefill_applies(step["q"][..., :32], step["meta"], 0, 0.0)  # a head size it skips


def test_bf16_prefill_attention_is_chosen_only_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_prefill_attention("float32", True) == (False, "--cpu-prefill-attention float32")
    with pytest.raises(EngineError, match="choose one of auto, bf16, float32"):
        choose_prefill_attention("fp8", True)
    if cpu_attention._prefill_kernel() is not None:
        assert choose_prefill_attention("auto", True)[0] and choose_prefill_attention("bf16", False)[0]
        keep, why = choose_prefill_attention("auto", False)
        assert not keep and "float32" in why  # exact matmuls asked for: exact attention too
    monkeypatch.setattr(cpu_attention, "bf16_prefill_cpu", lambda: False)  # an AVX2-only CPU
    keep, why = choose_prefill_attention("auto", True)
    assert not keep and "no AVX512-BF16" in why
    with pytest.raises(EngineError, match="needs AVX512-BF16"):
        choose_prefill_attention("bf16", True)
