"""GGUF weights kept in their blocks on the CPU (backends/cpu/gguf_linear.py, kernels/gguf_matmul.c).

The kernels are held to the `gguf` package's own dequantization times a float64 matmul (relative
error at float32 rounding), on SmolLM2's real Q4_1 and Q8_0 tensors and on random blocks, through
the AVX2 path and the portable C path, the fused decode path (<= 16 rows) and the prefill path
(dequantize + GEMM). The engine's greedy tokens through them are held to HF in test_hf_parity.py
(SmolLM2 from its GGUF runs this path by default). With the native kernels off (or no gcc) the
engine loads the GGUF dense: `test_without_native_kernels_the_gguf_loads_dense`.
"""

from __future__ import annotations

import functools
import os

import gguf
import numpy as np
import pytest
import torch

from backends.cpu import gguf_linear as gl
from engine.engine import Engine
from engine.errors import EngineError
from tests.conftest import track



def force_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """"selected": the path this CPU takes (AVX2 where it has it); "portable": the plain C path, which
    every CPU can run. Both run on every machine, so neither is ever skipped."""
    assert gl.gguf_kernels_available(), "the GGUF kernels did not build (gcc is a test requirement, as for tests/test_cpu_kernels.py)"
    if path == "portable":
        monkeypatch.setattr(gl, "simd_path", lambda: False)


@functools.lru_cache(maxsize=None)
def smol_tensor(path: str, name: str) -> tuple[torch.Tensor, torch.Tensor, gl.BlockFormat]:
    """(blocks, float32 dequantized by the gguf package, format) of one tensor of the GGUF file."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    blocks = torch.from_numpy(np.ascontiguousarray(np.asarray(tensor.data)))
    dense = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
    return blocks, dense, gl.FORMATS[tensor.tensor_type.name]


def random_quants(fmt: gl.BlockFormat, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, tuple[np.ndarray, ...]]:
    """Random blocks of `fmt` (scales and minimums as real fp16 values) and their parts: (scales
    [rows, blocks, 1], quants [rows, blocks, 32], minimums or None for Q8_0)."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    if fmt.name == "Q8_0":
        scales = rng.uniform(-0.02, 0.02, (rows, nb, 1)).astype(np.float16)
        quants = rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8)
        raw, minimums = np.concatenate([scales.view(np.uint8), quants.view(np.uint8)], axis=-1), None
    else:
        scales = rng.uniform(0.001, 0.02, (rows, nb, 1)).astype(np.float16)
        minimums = rng.uniform(-0.2, 0.0, (rows, nb, 1)).astype(np.float16)
        quants = rng.integers(0, 16, (rows, nb, 32), dtype=np.uint8)
        packed = (quants[..., :16] | (quants[..., 16:] << 4)).astype(np.uint8)
        raw = np.concatenate([scales.view(np.uint8), minimums.view(np.uint8), packed], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(raw.reshape(rows, -1))), (scales, quants, minimums)


def random_blocks(fmt: gl.BlockFormat, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of `fmt` and their float32 matrix."""
    blocks, (scales, quants, minimums) = random_quants(fmt, rows, cols, seed)
    dense = scales.astype(np.float32) * quants.astype(np.float32)
    if minimums is not None:
        dense = dense + minimums.astype(np.float32)
    return blocks, torch.from_numpy(dense.reshape(rows, cols))


def check_matmul(blocks: torch.Tensor, dense: torch.Tensor, fmt: gl.BlockFormat, rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = gl.gguf_linear(x, blocks, fmt.code, dense.shape[0])
    want = x.double() @ dense.double().T
    assert got.dtype == dtype and got.shape == want.shape
    error = float((got.double() - want).abs().max() / want.abs().max())
    assert error < (2e-6 if dtype == torch.float32 else 1e-2), error


@pytest.mark.parametrize("path", ["selected", "portable"])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.3.attn_k.weight", "token_embd.weight"])  # Q4_1, Q4_1, Q8_0
def test_kernels_on_smollm2_tensors(smol_gguf_path: str, monkeypatch: pytest.MonkeyPatch, path: str, rows: int, name: str) -> None:
    force_path(monkeypatch, path)
    blocks, dense, fmt = smol_tensor(smol_gguf_path, name)
    torch.testing.assert_close(gl.dequantize_blocks(blocks, fmt.code, *dense.shape), dense, atol=0, rtol=0)
    check_matmul(blocks, dense, fmt, rows, torch.float32)


@pytest.mark.parametrize("path", ["selected", "portable"])
@pytest.mark.parametrize("fmt_name", ["Q4_1", "Q8_0"])
def test_kernels_on_random_blocks(monkeypatch: pytest.MonkeyPatch, path: str, fmt_name: str) -> None:
    force_path(monkeypatch, path)
    fmt = gl.FORMATS[fmt_name]
    blocks, dense = random_blocks(fmt, 37, 96, seed=len(fmt_name) + len(path))
    for rows in (1, 5, 16, 20):
        check_matmul(blocks, dense, fmt, rows, torch.float32)
        check_matmul(blocks, dense, fmt, rows, torch.bfloat16)


def test_a_matrix_wider_than_the_fused_kernel_takes_the_dequantized_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gl, "FUSED_MAX_COLUMNS", 64)  # as a 53,248-wide down_proj would against 32,768
    fmt = gl.FORMATS["Q4_1"]
    blocks, dense = random_blocks(fmt, 8, 96, seed=3)
    check_matmul(blocks, dense, fmt, 1, torch.float32)


@pytest.mark.parametrize("fmt_name", ["Q4_1", "Q8_0"])
def test_quantized_embedding_gathers_the_dequantized_rows(fmt_name: str) -> None:
    fmt = gl.FORMATS[fmt_name]
    blocks, dense = random_blocks(fmt, 50, 64, seed=7)
    embedding = gl.QuantizedEmbedding(blocks, fmt, 64, torch.float32)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    torch.testing.assert_close(embedding(ids), dense[ids], atol=0, rtol=0)


def test_the_selected_path_follows_the_cpu() -> None:
    from backends.cpu.features import cpu_features

    assert gl.gguf_kernels_available()
    assert gl.simd_path() == (bool(gl._library().gguf_has_avx2()) and cpu_features().has("avx2", "fma3"))


def test_without_native_kernels_the_gguf_loads_dense(cpu_fast_paths_off: None) -> None:
    """The barest CPU (no native kernels, as without gcc): the same GGUF, dequantized at load."""
    from engine.layers.linear import Linear

    assert not gl.gguf_kernels_available()
    engine = track(Engine(device="cpu", disable_graphs=True, kv_cache_tokens=256))
    assert not any(m.method.name.startswith("gguf") for m in engine.model.modules() if isinstance(m, Linear))
    with pytest.raises(EngineError, match="could not be built"):
        Engine(device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256, quantization="gguf")


def test_the_default_engine_keeps_smollm2_in_its_blocks(smol_gguf_path: str) -> None:
    from engine.layers.linear import Linear

    engine = track(Engine(device="cpu", disable_graphs=True, kv_cache_tokens=256))
    assert engine.config.dtype == "float32"  # dtype auto with GGUF blocks: their kernels compute in float32
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert {m.method.name for m in linears} == {"gguf_q4_1", "gguf_q8_0"}
    assert engine.model.lm_head.gguf_blocks is engine.model.model.embed_tokens.gguf_blocks  # tied: one copy
    resident = sum(t.nbytes for t in [*engine.model.parameters(), *engine.model.buffers()] if t.dtype in (torch.uint8,))
    dense = sum(p.nbytes for p in engine.model.parameters())
    assert resident + dense <= 1.3 * os.path.getsize(smol_gguf_path), (resident, dense)


def test_quantization_none_dequantizes_and_gguf_needs_a_gguf(tiny_checkpoints: dict[str, str]) -> None:
    from engine.layers.linear import DENSE, Linear

    engine = track(Engine(device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256, quantization="none"))
    assert all(m.method is DENSE or m.method.name == "onednn_packed" for m in engine.model.modules() if isinstance(m, Linear))
    with pytest.raises(EngineError, match="--quantization gguf needs a GGUF model"):
        Engine(model=tiny_checkpoints["llama"], device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256,
               quantization="gguf")


def int8_reference(x: torch.Tensor, parts: tuple[np.ndarray, ...]) -> torch.Tensor:
    """llama.cpp's int8-activation product in float64: x quantized per block of 32 (scale max|x| / 127,
    round to nearest even), then sum over blocks of d * xd * (q . xq) (+ m * xd * sum(xq) for Q4_1)."""
    scales, quants, minimums = parts
    rows, cols = x.shape
    xb = x.double().numpy().reshape(rows, cols // 32, 32)
    xd = np.abs(xb).max(axis=-1, keepdims=True) / 127.0
    xq = np.rint(np.divide(xb, xd, out=np.zeros_like(xb), where=xd > 0))
    dots = np.einsum("ibj,rbj->irb", xq, quants.astype(np.float64))  # [x rows, w rows, blocks]
    out = dots * scales[None, :, :, 0].astype(np.float64) * xd[:, None, :, 0]
    if minimums is not None:
        out = out + minimums[None, :, :, 0].astype(np.float64) * xd[:, None, :, 0] * xq.sum(-1)[:, None, :]
    return torch.from_numpy(out.sum(-1))


@pytest.mark.parametrize("path", ["selected", "portable"])
@pytest.mark.parametrize("fmt_name", ["Q4_1", "Q8_0"])
def test_int8_activation_kernels_compute_llama_cpps_product(monkeypatch: pytest.MonkeyPatch, path: str, fmt_name: str) -> None:
    """The integer dot products are exact, so against the same quantization in float64 the kernels
    differ only by float32 rounding of the per-block scales and the sums."""
    force_path(monkeypatch, path)
    fmt = gl.FORMATS[fmt_name]
    rows_w, cols = 29, 160
    blocks, parts = random_quants(fmt, rows_w, cols, seed=11)
    for rows in (1, 4, 16):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        x[0, 32:64] = 0.0  # an all-zero block: scale 0, no division by it
        got = gl.gguf_linear(x, blocks, fmt.code, rows_w, int8_activations=True)
        want = int8_reference(x, parts)
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < 2e-6, error
        exact = x.double() @ torch.from_numpy(gl.dequantize_blocks(blocks, fmt.code, rows_w, cols).numpy()).double().T
        # And what quantizing the activations costs: within a few parts in a thousand of the float path.
        assert float((got.double() - exact).abs().max() / exact.abs().max()) < 2e-2


def test_int8_activations_keep_smollm2s_greedy_text_close(smol_gguf_path: str) -> None:
    """The whole model with int8 activations (llama.cpp runs this GGUF this way): the first greedy
    tokens match the exact path's, the top-5 next tokens are the same, and the last-position logits
    stay within 6% of the logit scale (measured 2.5-4.3% on three prompts: every activation of 30
    layers and the tied head is rounded to 1/254 of its block's largest, so this is noise, not a bug;
    the kernel itself is held to its exact numerics above)."""
    from engine.sampling_params import SamplingParams
    from helpers import engine_logits

    exact = track(Engine(device="cpu", disable_graphs=True, kv_cache_tokens=512))
    fast = track(Engine(device="cpu", disable_graphs=True, kv_cache_tokens=512, gguf_activations="int8"))
    assert {m.method.name for m in fast.model.modules() if hasattr(m, "gguf_blocks") and hasattr(m, "method")} == {
        "gguf_q4_1_int8_activations", "gguf_q8_0_int8_activations"}
    prompt = exact.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert fast.generate([prompt], params)[0].token_ids == exact.generate([prompt], params)[0].token_ids
    want, _ = engine_logits(exact, prompt, 0)
    got, _ = engine_logits(fast, prompt, 0)
    assert set(got.topk(5).indices.tolist()) == set(want.topk(5).indices.tolist())
    assert float((got - want).abs().max() / want.abs().max()) < 6e-2
