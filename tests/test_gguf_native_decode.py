"""The native GGUF decode step (backends/cpu/gguf_decode.py, kernels/gguf_decode.c) behind the decode contract.

Tiny GGUF files of four Llama-family layouts, written with the `gguf` package's writer in mixed
block formats (tests/gguf_files.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 by its quantizer, Q2_K, Q3_K, Q4_K, Q5_K
and Q6_K by ours): plain Llama in Q4_K with Q6_K v/down/head (a Q4_K_M file's mix), the same in Q5_K (a
Q5_K_M file's mix) with a Q5_1 k and a Q5_0 embedding, in Q3_K with Q4_K v, Q5_K down and a Q3_K
embedding (a Q3_K_M file's kind of mix), in Q2_K with Q3_K v/down and a Q2_K embedding (a Q2_K file's),
Qwen2's q/k/v bias in Q4_0 with a Q8_0 k, Qwen3's q/k norms in Q4_1 with a Q4_K o_proj, Mistral with a
24-token sliding window in Q6_K, and heads of 128 and 32 (the attention's other two code shapes) in Q8_0 and Q4_0. Each
decodes through the native step and is held to the same file dequantized at load (the dense path,
itself held to HF in test_gguf_families.py and test_hf_parity.py): greedy ids over 32 tokens, prompts
arriving at different steps, page sizes 1 and 16, prefix caching on, on every code path this CPU
has (features hidden to force AVX2 and portable C), float32 and the default int8x2 activations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import build_tiny_checkpoint, track
from gguf_files import write_gguf
from helpers import engine_logits, run_staggered

from backends.cpu.gguf_decode import NativeDecodeRunner
from backends.cpu.platform import forget_cpu_paths
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from graphs.compiled_runner import CompiledDecodeRunner, compile_count


def require_kernels() -> None:
    from backends.cpu.gguf_linear import gguf_kernels_available
    from backends.cpu.native import native_kernels_enabled

    if not native_kernels_enabled():  # a failure, not a skip: gcc is a test requirement (the fallbacks are
        # tested by the suite's fast-paths-off cases)
        pytest.fail("ENGINE_CPU_NATIVE_KERNELS=0 switches the native decode step off: run this file with it on")
    assert gguf_kernels_available(), "the GGUF kernels did not build (gcc is a test requirement)"


# case -> (tiny checkpoint, its overrides, GGUF block formats by llama.cpp tensor kind ("*": the rest)).
# Head sizes: 64 (the vector attention), 128 (the same, 8 vectors a head), 32 (the plain loops).
CASES: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
    "llama_plain": (
        "llama_plain",
        {},
        {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K"},
    ),
    "llama_q5": (
        "llama_plain",
        {},
        {"*": "Q5_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_k": "Q5_1", "token_embd": "Q5_0", "output": "Q6_K"},
    ),
    "llama_q3": (
        "llama_plain",
        {},
        {"*": "Q3_K", "attn_v": "Q4_K", "ffn_down": "Q5_K", "token_embd": "Q3_K", "output": "Q6_K"},
    ),
    "llama_q2": (
        "llama_plain",
        {},
        {"*": "Q2_K", "attn_v": "Q3_K", "ffn_down": "Q3_K", "token_embd": "Q2_K", "output": "Q6_K"},
    ),
    "qwen2": ("qwen2", {}, {"*": "Q4_0", "attn_k": "Q8_0"}),
    "qwen3": ("qwen3", {"head_dim": 64}, {"*": "Q4_1", "attn_output": "Q4_K"}),
    "mistral": ("mistral", {"sliding_window": 24}, {"*": "Q6_K", "token_embd": "Q4_0"}),
    "llama_head_128": ("llama_plain", {"num_attention_heads": 2, "num_key_value_heads": 1}, {"*": "Q8_0"}),
    "qwen3_head_32": ("qwen3", {"head_dim": 32}, {"*": "Q4_0"}),
}
# Features hidden per code path (nothing hidden: the best this CPU has).
PATHS = {"best": "", "avx2": "avx512_f,avx512_vnni,avx_vnni", "portable": "all"}
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
ARRIVALS = [0, 1, 3]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> a quantized tiny GGUF (K-quants need 256-column rows: hidden 256, intermediate 512)."""
    root = tmp_path_factory.mktemp("quantized_ggufs")
    paths = {}
    for name, (spec, overrides, formats) in CASES.items():
        folder = build_tiny_checkpoint(spec, str(root / name), hidden_size=256, intermediate_size=512, **overrides)
        paths[name] = write_gguf(folder, str(root / f"{name}.gguf"), formats)
    return paths


@pytest.fixture
def code_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Engines built inside run the GGUF kernels of request.param (features hidden), restored after."""
    hidden = PATHS[request.param]
    if hidden:
        monkeypatch.setenv("ENGINE_CPU_HIDE_FEATURES", hidden)
    forget_cpu_paths()
    yield request.param
    monkeypatch.undo()
    forget_cpu_paths()


def prompts_for(engine: Engine) -> list[list[int]]:
    vocab = engine.model_config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 17)]


def dense_ids(path: str, page_size: int) -> list[list[int]]:
    dense = track(
        Engine(
            model=path,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=1024,
            disable_graphs=True,
            max_num_seqs=4,
            page_size=page_size,
            quantization="none",
        )
    )
    return run_staggered(dense, prompts_for(dense), PARAMS, ARRIVALS).token_ids


def native_engine(path: str, page_size: int, activations: str = "auto", **options: Any) -> Engine:
    require_kernels()
    engine = track(
        Engine(
            model=path,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=1024,
            capture_sizes="1,2,4",
            max_num_seqs=4,
            page_size=page_size,
            gguf_activations=activations,
            # The block kernels for prefill too: the dense path is held to them (bf16 prefill's numerics flip
            # near-ties in these tiny random models; tests/test_cpu_prefill_weights.py holds it to HF).
            cpu_prefill_weights="gguf",
            **options,
        )
    )
    assert isinstance(engine.runner.graph_runner, NativeDecodeRunner)
    return engine


@pytest.mark.parametrize("activations", ["float32", "auto"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_native_decode_gives_the_dense_paths_tokens(
    tiny_ggufs: dict[str, str], name: str, page_size: int, activations: str
) -> None:
    engine = native_engine(tiny_ggufs[name], page_size, activations)
    graph_steps = engine.runner.graph_steps
    run = run_staggered(engine, prompts_for(engine), PARAMS, ARRIVALS)
    assert run.token_ids == dense_ids(tiny_ggufs[name], page_size)
    assert {1, 2, 3} <= set(run.decode_sizes)  # batches of every size, 3 not padded
    assert engine.runner.graph_steps - graph_steps == len(run.decode_sizes)  # every decode step native
    assert engine.kv_pages_in_use() == 0


@pytest.mark.parametrize("activations", ["float32", "auto", "int8"])
@pytest.mark.parametrize("code_path", list(PATHS), indirect=True)
@pytest.mark.parametrize("name", ["llama_plain", "llama_q5", "llama_q3", "llama_q2"])
def test_every_code_path_runs_the_native_step(
    tiny_ggufs: dict[str, str], name: str, code_path: str, activations: str
) -> None:
    """Llama with Q4_K, Q6_K and Q8_0 in one model (and with Q5_K, Q5_1, Q5_0 and Q6_K; with Q3_K, Q4_K, Q5_K
    and Q6_K; with Q2_K, Q3_K and Q6_K), through AVX512, AVX2 and portable C kernels. int8 (one level,
    llama.cpp's numerics) is held to the same file's eager engine with the same activations."""
    from backends.cpu.gguf_linear import code_paths

    if code_path != "best":
        assert max(code_paths()) <= (1 if code_path == "avx2" else 0)
    path = tiny_ggufs[name]
    engine = native_engine(path, 16, activations)
    got = run_staggered(engine, prompts_for(engine), PARAMS, ARRIVALS).token_ids
    if activations == "int8":
        eager = track(
            Engine(
                model=path,
                device="cpu",
                dtype="float32",
                kv_cache_tokens=1024,
                disable_graphs=True,
                max_num_seqs=4,
                page_size=16,
                gguf_activations="int8",
                cpu_prefill_weights="gguf",  # the same kernels as the native engine's prefill
            )
        )
        assert got == run_staggered(eager, prompts_for(eager), PARAMS, ARRIVALS).token_ids
    else:
        assert got == dense_ids(path, 16)


def test_prefix_caching_overlap_and_chunked_prefill(tiny_ggufs: dict[str, str]) -> None:
    """A second run of the same prompts reuses their cached pages; overlap scheduling feeds the native
    step input tokens still on the device (PENDING rows); prefill chunks of 8 tokens; mixed steps."""
    path = tiny_ggufs["qwen3"]
    want = dense_ids(path, 16)
    engine = native_engine(path, 16, overlap_schedule=True, mixed_steps=True, max_prefill_tokens=8)
    assert run_staggered(engine, prompts_for(engine), PARAMS, ARRIVALS).token_ids == want
    hits = engine.stats().prefix_cache_hit_tokens
    assert run_staggered(engine, prompts_for(engine), PARAMS, ARRIVALS).token_ids == want
    assert engine.stats().prefix_cache_hit_tokens - hits >= 16 + 32  # the 17- and 40-token prompts' full pages


def test_a_bfloat16_model_decodes_natively_too(tiny_ggufs: dict[str, str]) -> None:
    """The native step computes in float32 whatever the model's dtype (its norms, bias and rotary tables
    copied to float32; the KV cache is float32 on the CPU either way). A bf16 model's decode logits
    after its bf16 prefill, against the float32 model's: measured 2.7-6.6% of the logit scale (the
    bf16 eager step: 3.1-13%: these random tiny models amplify bf16 rounding, enough to move an argmax);
    bf16 bytes read as float32 anywhere would be off by orders of magnitude."""
    require_kernels()
    path = tiny_ggufs["qwen2"]
    options = dict(
        model=path, device="cpu", kv_cache_tokens=1024, max_num_seqs=1, page_size=16, gguf_activations="float32"
    )
    native = track(Engine(capture_sizes="1", dtype="bfloat16", **options))
    exact = track(Engine(disable_graphs=True, dtype="float32", **options))
    assert isinstance(native.runner.graph_runner, NativeDecodeRunner)
    for ids in prompts_for(native):
        _, want = engine_logits(exact, ids, 42)
        _, got = engine_logits(native, ids, 42)
        assert float((got - want).abs().max()) < 0.1 * float(want.abs().max())


def test_decode_logits_of_the_default_against_exact(smol_gguf_path: str) -> None:
    """SmolLM2's default (int8x2) decode logits through the native step against float32 activations
    through the native step: within 1e-3 of the logit scale (measured 1.7e-4 to 2.1e-4), same argmax;
    float32 through the native step against the eager float32 path: float32 rounding (2e-6)."""
    require_kernels()
    exact_native = track(
        Engine(device="cpu", kv_cache_tokens=1024, capture_sizes="1", max_num_seqs=1, gguf_activations="float32")
    )
    exact_eager = track(
        Engine(device="cpu", kv_cache_tokens=1024, disable_graphs=True, max_num_seqs=1, gguf_activations="float32")
    )
    default = track(Engine(device="cpu", kv_cache_tokens=1024, capture_sizes="1", max_num_seqs=1))
    assert isinstance(default.runner.graph_runner, NativeDecodeRunner)
    for text in ("The capital of France is", "def fibonacci(n):\n    "):
        ids = exact_eager.tokenizer.encode(text)
        _, want = engine_logits(exact_eager, ids, 42)
        _, native = engine_logits(exact_native, ids, 42)
        _, fast = engine_logits(default, ids, 42)
        scale = float(want.abs().max())
        assert float((native - want).abs().max()) < 1e-5 * scale
        assert float((fast - want).abs().max()) < 1e-3 * scale
        assert int(fast.argmax()) == int(want.argmax())


def test_models_the_native_step_does_not_take_run_compiled_graphs(
    tiny_checkpoints: dict[str, str], tiny_ggufs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dense checkpoint, and a GGUF when the native step is refused: the compiled graphs, over the
    engine::gguf_linear op (inside torch.compile) in the second case, same tokens as the native step."""
    from backends.cpu import gguf_decode

    require_kernels()
    dense = track(
        Engine(
            model=tiny_checkpoints["llama"],
            device="cpu",
            dtype="float32",
            kv_cache_tokens=512,
            capture_sizes="1,2",
            max_num_seqs=2,
        )
    )
    assert isinstance(dense.runner.graph_runner, CompiledDecodeRunner)
    path = tiny_ggufs["qwen2"]
    native = native_engine(path, 16, "float32")
    prompts = prompts_for(native)
    want = run_staggered(native, prompts, PARAMS, ARRIVALS).token_ids
    monkeypatch.setattr(gguf_decode, "native_step_unsupported", lambda model, caches: "refused by the test")
    compiled = track(
        Engine(
            model=path,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=1024,
            capture_sizes="1,2,4",
            max_num_seqs=4,
            page_size=16,
            gguf_activations="float32",
            strict_graphs=True,
        )
    )
    assert isinstance(compiled.runner.graph_runner, CompiledDecodeRunner)
    compiles = compile_count()
    assert run_staggered(compiled, prompts, PARAMS, ARRIVALS).token_ids == want
    assert compile_count() == compiles


def test_native_step_unsupported_names_what_is_in_the_way(
    tiny_checkpoints: dict[str, str], cpu_fast_paths_off: None
) -> None:
    from backends.cpu.gguf_decode import native_step_unsupported

    engine = track(Engine(device="cpu", kv_cache_tokens=256, capture_sizes="1", max_num_seqs=1))
    assert isinstance(engine.runner.graph_runner, CompiledDecodeRunner)  # no native kernels: SmolLM2 loads dense
    assert native_step_unsupported(engine.model, engine.kv_pool.caches) == "the native GGUF kernels are not built here"
