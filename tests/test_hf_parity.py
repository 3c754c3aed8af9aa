"""Held against HF transformers on the same weights: greedy token ids and last-position logits.

Every comparison batches 4 prompts of different lengths that arrive at different steps
(add_request between step() calls), at page sizes 1 and 16, eagerly and through the
compiled decode graphs (capture sizes 1,2,4: decode batches of 1, 2 and 4 replay a graph of
their own size, batches of 3 are padded to 4). The HF side runs each prompt alone, unpadded.

Greedy cases also run in two variants of the CPU engine: `overlap+mixed` (the CUDA defaults' step loop:
step N+1 launched before step N's tokens are read, decodes and prefill chunks in one step) and
`fast-paths-off` (no native kernels, no oneDNN packing, no CPU features: the torch fallbacks a bare x86-64
or aarch64 CPU takes). Every family runs both eagerly; a few run them through the compiled graphs too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import (
    LOOPS,
    NEW_TOKENS,
    engine_logits,
    get_engine,
    graph_options,
    greedy,
    hf_greedy,
    hf_last_logits,
    run_staggered,
)

from engine.engine import Engine
from graphs.compiled_runner import compile_count

# (mode, page size): every model runs these.
MODES = [("eager", 16), ("eager", 1), ("graphs", 16)]
# Graphs at page size 1 for the embedded model and two tiny families (compiles are the slow part).
GRAPHS_PAGE_1 = ("graphs", 1)
# The engine's variants besides its CPU defaults ("default"); see the module's docstring.
VARIANTS = ("default", "overlap+mixed", "fast-paths-off")


def variant_options(request: pytest.FixtureRequest, variant: str) -> dict[str, Any]:
    """Engine options of a variant; fast-paths-off switches the CPU's fast paths off for this test."""
    if variant == "fast-paths-off":
        request.getfixturevalue("cpu_fast_paths_off")
        return {}
    if variant == "prefill-auto":  # the CPU's default prefill path (engine_cache pins the block kernels)
        return {"cpu_prefill_weights": "auto"}
    return LOOPS["overlap+mixed"] if variant == "overlap+mixed" else {}


def first_divergence(ours: list[int], theirs: list[int]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"first divergence at new token {i}: ours {a} vs HF {b}; ours {ours} vs HF {theirs}"
    return f"lengths differ: {len(ours)} vs {len(theirs)}"


def check_run(engine: Engine, mode: str, prompts: list, arrivals: list[int], expected: list[list[int]]):
    compiles_before = compile_count()
    graph_steps_before = engine.runner.graph_steps
    run = run_staggered(engine, prompts, greedy(), arrivals)
    for i, output in enumerate(run.outputs):
        assert len(output.token_ids) == NEW_TOKENS, output.finish_reason
        assert output.token_ids == expected[i], f"prompt {i}: " + first_divergence(output.token_ids, expected[i])
        assert output.finish_reason == "length"
    # The arrival schedule really produced mixed batch sizes, padded (3) and exact (1, 4) ones.
    assert {1, 3, 4} <= set(run.decode_sizes), run.decode_sizes
    if mode == "graphs":
        # Every decode step replayed a captured graph and nothing compiled while serving.
        assert engine.runner.graph_steps - graph_steps_before == len(run.decode_sizes)
        assert compile_count() == compiles_before
    return run


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the embedded GGUF, text prompts
# ---------------------------------------------------------------------------------------------

SMOL_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He was followed by "
    "Buzz Aldrin, while Michael Collins stayed in orbit around it. The name of the mission was",
    "def fibonacci(n):\n    ",
]
SMOL_ARRIVALS = [0, 2, 4, 4]


@pytest.fixture(scope="module")
def smol_reference(smol_hf: tuple[Any, Any]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids by HF's GGUF tokenizer, HF greedy continuations)."""
    model, tokenizer = smol_hf
    prompt_ids = [tokenizer.encode(p) for p in SMOL_PROMPTS]
    assert len({len(p) for p in prompt_ids}) == len(prompt_ids)  # all different lengths
    assert max(len(p) for p in prompt_ids) > 16  # one spans several pages
    return prompt_ids, [hf_greedy(model, ids) for ids in prompt_ids]


@pytest.mark.parametrize(
    "mode,page_size,variant",
    [
        *((*case, "default") for case in [*MODES, GRAPHS_PAGE_1]),
        ("eager", 16, "overlap+mixed"),
        ("graphs", 16, "overlap+mixed"),
        ("eager", 16, "prefill-auto"),
        ("graphs", 16, "prefill-auto"),
    ],
)
def test_smollm2_greedy_matches_hf(
    request: pytest.FixtureRequest,
    engine_cache: Callable[..., Engine],
    smol_hf: tuple[Any, Any],
    smol_reference: tuple,
    mode: str,
    page_size: int,
    variant: str,
) -> None:
    engine = get_engine(engine_cache, None, mode, page_size, **variant_options(request, variant))
    prompt_ids, expected = smol_reference
    run = check_run(engine, mode, SMOL_PROMPTS, SMOL_ARRIVALS, expected)
    _, tokenizer = smol_hf
    for i, output in enumerate(run.outputs):
        assert output.prompt_token_ids == prompt_ids[i]  # same tokenization as HF
        assert output.text == tokenizer.decode(expected[i], skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_smollm2_matches_hf_with_every_cpu_fast_path_off(
    cpu_fast_paths_off: None, smol_reference: tuple, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallbacks a CPU without AVX512, without gcc or without oneDNN would run, in float32."""
    from conftest import track

    from backends.cpu.attention import native_decode_available
    from backends.cpu.packed_linear import _PACKED_ATTR

    options = graph_options(16) if mode == "graphs" else dict(max_num_seqs=4)
    with caplog.at_level("INFO", logger="backends.cpu.platform"):
        engine = track(
            Engine(device="cpu", dtype="float32", kv_cache_tokens=2048, **{"disable_graphs": True, **options})
        )
    assert not native_decode_available()
    assert not any(hasattr(p, _PACKED_ATTR) for p in engine.model.parameters())
    assert "linear: F.linear float32" in caplog.text and "decode attention: torch ops" in caplog.text
    _, expected = smol_reference
    check_run(engine, mode, SMOL_PROMPTS, SMOL_ARRIVALS, expected)


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints, token-id prompts
# ---------------------------------------------------------------------------------------------

TINY_NAMES = [
    "llama",
    "llama_plain",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "gemma2",
    "gemma3",
]
TINY_PROMPT_LENGTHS = [1, 7, 16, 37]  # one token, under a page, exactly a page, several pages
TINY_ARRIVALS = [0, 2, 2, 5]
TINY_CASES = [
    *((name, mode, page, "default") for name in TINY_NAMES for mode, page in MODES),
    ("qwen2", *GRAPHS_PAGE_1, "default"),
    ("qwen3", *GRAPHS_PAGE_1, "default"),
    # Each family in both variants eagerly; through the graphs, a dense and an MoE family with the step loop
    # changed, and Gemma 2 (soft-caps, a sliding window) on the fallbacks.
    *((name, "eager", 16, variant) for name in TINY_NAMES for variant in VARIANTS[1:]),
    ("llama", "graphs", 16, "overlap+mixed"),
    ("qwen3_moe", "graphs", 16, "overlap+mixed"),
    ("gemma2", "graphs", 16, "fast-paths-off"),
]


def tiny_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in TINY_PROMPT_LENGTHS]


_TINY_REFERENCE: dict[str, tuple[list[list[int]], list[list[int]]]] = {}


@pytest.fixture(scope="module")
def tiny_reference(hf_tiny: Callable[[str], Any]) -> Callable[[str], tuple[list[list[int]], list[list[int]]]]:
    def get(name: str) -> tuple[list[list[int]], list[list[int]]]:
        if name not in _TINY_REFERENCE:
            model = hf_tiny(name)
            prompts = tiny_prompts(model.config.vocab_size)
            _TINY_REFERENCE[name] = (prompts, [hf_greedy(model, p) for p in prompts])
        return _TINY_REFERENCE[name]

    return get


@pytest.mark.parametrize("name,mode,page_size,variant", TINY_CASES)
def test_tiny_greedy_matches_hf(
    request: pytest.FixtureRequest,
    engine_cache: Callable[..., Engine],
    tiny_checkpoints: dict[str, str],
    tiny_reference: Callable,
    name: str,
    mode: str,
    page_size: int,
    variant: str,
) -> None:
    prompts, expected = tiny_reference(name)
    engine = get_engine(engine_cache, tiny_checkpoints[name], mode, page_size, **variant_options(request, variant))
    check_run(engine, mode, prompts, TINY_ARRIVALS, expected)


# ---------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------

# Tolerance, relative to the logit scale (max |logit| of the HF reference):
# both sides compute in float32 (eps 1.2e-7) from bit-identical weights; they differ only in
# summation order (our fused qkv / gate_up matmuls, paged SDPA over gathered pages vs HF's
# contiguous cache), which in fp32 leaves errors of order sqrt(K) * eps per reduction, grown
# through at most 30 layers: measured max |diff| ~6e-6 at logit scale ~5 on the tiny models and
# ~6e-5 at scale ~25 on SmolLM2, i.e. 1e-6 to 3e-6 relative.
# A real bug (a wrong rope table, a missing bias or norm, a wrong page, a mis-mapped weight)
# moves logits by O(1) relative. 1e-4 sits a decade above the noise and four below a bug.
LOGIT_RTOL = 1e-4


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor, what: str, rtol: float = LOGIT_RTOL) -> None:
    assert ours.shape == reference.shape, (what, ours.shape, reference.shape)
    assert ours.dtype == torch.float32
    scale = float(reference.abs().max())
    diff = float((ours - reference).abs().max())
    assert diff <= rtol * max(scale, 1.0), f"{what}: max |diff| {diff:.3g} at logit scale {scale:.3g}"
    assert int(ours.argmax()) == int(reference.argmax()), what


# SmolLM2's GGUF blocks by default take matmul inputs as two int8 levels per block of 32 (--gguf-activations
# auto = int8x2, ~16-bit activations: docs/quantization.md), prefill and decode alike: measured 2.8e-5 to
# 2.4e-4 of the logit scale from HF on these prompts (prefill of 5 and 42 tokens, and decode). float32
# activations are held to 1e-4 (measured 1.6e-6 to 2.8e-6).
INT8X2_LOGIT_RTOL = 1e-3


@pytest.mark.parametrize("activations", ["float32", "auto"])
@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_smollm2_logits_match_hf(
    engine_cache: Callable[..., Engine], smol_hf: tuple[Any, Any], mode: str, activations: str
) -> None:
    model, tokenizer = smol_hf
    options = graph_options(16) if mode == "graphs" else dict(page_size=16, max_num_seqs=4)
    engine = engine_cache(None, gguf_activations=activations, **options)
    rtol = LOGIT_RTOL if activations == "float32" else INT8X2_LOGIT_RTOL
    graph_steps = engine.runner.graph_steps
    for prompt in (SMOL_PROMPTS[0], SMOL_PROMPTS[2]):
        ids = tokenizer.encode(prompt)
        next_token = int(hf_last_logits(model, ids).argmax())
        prefill, decode = engine_logits(engine, ids, next_token)
        assert_logits_close(prefill, hf_last_logits(model, ids), f"prefill of {prompt[:20]!r}", rtol)
        assert_logits_close(decode, hf_last_logits(model, [*ids, next_token]), f"decode after {prompt[:20]!r}", rtol)
    if mode == "graphs":
        assert engine.runner.graph_steps == graph_steps + 2  # the decode logits came from the graph


@pytest.mark.parametrize("name", TINY_NAMES)
@pytest.mark.parametrize("mode,page_size", [("eager", 1), ("graphs", 16)])
def test_tiny_logits_match_hf(
    engine_cache: Callable[..., Engine],
    tiny_checkpoints: dict[str, str],
    hf_tiny: Callable[[str], Any],
    name: str,
    mode: str,
    page_size: int,
) -> None:
    model = hf_tiny(name)
    engine = get_engine(engine_cache, tiny_checkpoints[name], mode, page_size)
    graph_steps = engine.runner.graph_steps
    prompts = tiny_prompts(model.config.vocab_size, seed=1)[1:]
    for ids in prompts:
        next_token = int(hf_last_logits(model, ids).argmax())
        prefill, decode = engine_logits(engine, ids, next_token)
        assert_logits_close(prefill, hf_last_logits(model, ids), f"{name} prefill of {len(ids)} tokens")
        assert_logits_close(decode, hf_last_logits(model, [*ids, next_token]), f"{name} decode at {len(ids) + 1}")
    if mode == "graphs":
        assert engine.runner.graph_steps == graph_steps + len(prompts)


def test_tied_and_untied_heads_are_both_covered(
    tiny_checkpoints: dict[str, str], hf_tiny: Callable[[str], Any]
) -> None:
    """The tiny set has both a tied and an untied LM head, and q/k/v bias where Qwen2 has it."""
    tied = {name: bool(hf_tiny(name).config.tie_word_embeddings) for name in TINY_NAMES}
    assert True in tied.values() and False in tied.values(), tied
    bias = hf_tiny("qwen2").model.layers[0].self_attn.q_proj.bias
    assert bias is not None and float(bias.detach().abs().sum()) > 0
