"""The one-row Triton GEMV (backends/cuda/gemv.py) against F.linear, and its linear method.

Compiled on a GPU; in Triton's interpreter elsewhere (float32), so the kernel's tiling, masks and
epilogue are checked on every CI machine."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreter_mode

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def kernel_mode():
    return nullcontext() if ON_GPU else interpreter_mode()


@pytest.mark.parametrize("n,k", [(64, 512), (40, 96), (13, 1030)])  # even tiles; ragged rows; ragged rows and columns
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(n: int, k: int, with_bias: bool) -> None:
    from backends.cuda.gemv import GemvConfig, gemv

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    generator = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    with kernel_mode():
        got = [
            gemv(x, weight, bias, config=GemvConfig(block_n, block_k, 4, 1)) for block_n, block_k in ((8, 512), (4, 64))
        ]
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out in got:
        assert out.dtype == dtype and out.shape == (1, n)
        torch.testing.assert_close(out.float(), want, atol=tol * k**0.5, rtol=tol)


def test_gemv_fp8_rows_with_scales() -> None:
    """e4m3 weights widened in registers, times a float32 scale per row: the FP8 reference's numerics."""
    from backends.cuda.gemv import GemvConfig, gemv
    from engine.quantization.fp8 import fp8_reference_linear, quantize_per_channel

    generator = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x = torch.randn(1, 256, generator=generator).to(DEVICE, dtype)
    weight, scale = quantize_per_channel(torch.randn(48, 256, generator=generator) * 0.05)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    with kernel_mode():  # the interpreter widens e4m3 exactly (it only narrows wrongly)
        got = gemv(x, weight, None, scale, GemvConfig(8, 128, 4, 1))
    want = fp8_reference_linear(x, weight, scale, None)
    tol = 2e-2 if ON_GPU else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_gemv_refuses_more_than_one_row() -> None:
    from backends.cuda.gemv import gemv

    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8))


def test_gemv_method_takes_one_row_inputs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The method's op runs the GEMV for one row and F.linear for more; use_gemv switches the dense
    bf16/fp16 linears under the size bound and nothing else."""
    import backends.cuda.gemv as gemv_module
    from backends.cuda.gemv import GEMV, use_gemv
    from engine.layers.linear import DENSE, Linear

    dtype = torch.bfloat16
    model = torch.nn.ModuleList([Linear(64, 96, bias=True), Linear(64, 32), Linear(8, 8)]).to(DEVICE, dtype)
    model[2].float()  # float32: stays dense
    assert use_gemv(model) == 2
    assert model[0].method is GEMV and model[1].method is GEMV and model[2].method is DENSE
    monkeypatch.setattr(gemv_module, "GEMV_MAX_WEIGHT_BYTES", 64 * 64 * 2 - 1)  # one byte short of a 64 x 64 bf16
    assert use_gemv(torch.nn.ModuleList([Linear(64, 64).to(dtype), Linear(32, 64).to(dtype)])) == 1
    # The platform decides whether its linears take the GEMV at all: ROCm keeps its BLAS (never measured there).
    from backends.hip.platform import HipPlatform

    kept = torch.nn.ModuleList([Linear(32, 64).to(dtype)])
    HipPlatform().prepare_model(kept, {})
    assert kept[0].method is DENSE
    if not ON_GPU:
        return  # the op's GEMV branch runs on CUDA tensors only; the kernel itself is tested above
    for rows in (1, 3):
        x = torch.randn(rows, 64, device=DEVICE, dtype=dtype)
        torch.testing.assert_close(
            model[0](x).float(), F.linear(x, model[0].weight, model[0].bias).float(), atol=2e-2, rtol=2e-2
        )


def test_config_chunks_divide_the_row_where_they_can() -> None:
    """Tiles by shape: Llama-3-8B's as the H200 sweep chose them; a row 1,024 does not divide (Gemma-2-9B's
    3,584) in 512-column chunks, which took its batch-1 step from 7.18 to 5.77 ms on the H200."""
    from backends.cuda.gemv import GemvConfig, choose_config

    assert choose_config(6144, 4096, 2) == GemvConfig(16, 512, 8, 1)  # Llama q/k/v
    assert choose_config(28672, 4096, 2) == GemvConfig(4, 1024, 4, 1)  # Llama gate/up
    assert choose_config(4096, 14336, 2) == GemvConfig(16, 1024, 8, 1)  # Llama down
    assert choose_config(28672, 3584, 2) == GemvConfig(4, 512, 4, 1)  # Gemma-2-9B gate/up: no masked tail
    assert choose_config(256000, 3584, 2) == GemvConfig(4, 512, 4, 1)  # its LM head
    assert choose_config(3584, 14336, 2) == GemvConfig(16, 1024, 8, 1)  # its down: 1,024 divides 14,336
    assert choose_config(4096, 1000, 2) == GemvConfig(16, 512, 8, 1)  # 512 does not divide either: unchanged


def test_gemv_writes_zeros_to_the_padding_rows() -> None:
    """out_rows > 1 (a batch-1 graph captured over a padding row, engine/layers/live_rows.py): the first row
    is the product, every row after it zeros, whatever the output held before (NaN here)."""
    from backends.cuda.gemv import GemvConfig, gemv

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(1, 96, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(40, 96, generator=generator).to(DEVICE, dtype)
    out = torch.full((3, 40), float("nan"), device=DEVICE, dtype=dtype)
    with kernel_mode():
        got = gemv(x, weight, None, config=GemvConfig(8, 64, 4, 1), out_rows=3, out=out)
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:1].float(), F.linear(x.float(), weight.float()), atol=tol * 96**0.5, rtol=tol)
    assert torch.equal(got[1:], torch.zeros_like(got[1:]))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, weight, out_rows=2, out=out)


def test_live_rows_scope() -> None:
    from engine.layers.live_rows import live_rows, only_first_rows_live

    assert live_rows(4) == 4
    with only_first_rows_live(1):
        assert live_rows(2) == 1 and live_rows(1) == 1
        with only_first_rows_live(3):
            assert live_rows(2) == 2 and live_rows(8) == 3
        assert live_rows(5) == 1
    assert live_rows(2) == 2
    with pytest.raises(ValueError, match="at least one"), only_first_rows_live(0):
        pass


@pytest.mark.skipif(not ON_GPU, reason="the op's GEMV branch runs on CUDA tensors only")
def test_gemv_op_computes_the_live_row_alone() -> None:
    """Inside only_first_rows_live(1) the dense GEMV op runs the first row through the GEMV and zeros the
    rest; outside it, the same rows go to cuBLAS whole."""
    from backends.cuda.gemv import GEMV, use_gemv
    from engine.layers.linear import Linear
    from engine.layers.live_rows import only_first_rows_live

    layer = torch.nn.ModuleList([Linear(64, 96, bias=True)]).to(DEVICE, torch.bfloat16)
    assert use_gemv(layer) == 1 and layer[0].method is GEMV
    x = torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16)
    want = F.linear(x, layer[0].weight, layer[0].bias).float()
    torch.testing.assert_close(layer[0](x).float(), want, atol=2e-2, rtol=2e-2)
    with only_first_rows_live(1):
        got = layer[0](x)
    torch.testing.assert_close(got[:1].float(), want[:1], atol=2e-2, rtol=2e-2)
    assert torch.equal(got[1:], torch.zeros_like(got[1:]))


def test_batch1_is_captured_over_two_rows_for_dense_models_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE model keeps its size-1 compile (a padding row would route to experts of its own and read their
    weights); a dense one takes the two-row graph."""
    from engine.layers.linear import Linear
    from engine.layers.moe import SparseMoE
    from graphs.cuda_graph_runner import batch1_in_two_rows

    dense = torch.nn.ModuleList([Linear(8, 8)])
    moe = torch.nn.ModuleList(
        [Linear(8, 8), torch.nn.ModuleList([SparseMoE(8, 16, num_experts=4, top_k=2, renormalize=True)])]
    )
    assert batch1_in_two_rows(dense) and not batch1_in_two_rows(moe)
