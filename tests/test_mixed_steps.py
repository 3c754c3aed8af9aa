"""One ragged step: running decodes and prefill chunks in the same step (`mixed_steps`).

Held against separate prefill and decode steps on the same weights (float32,
greedy): identical tokens with requests arriving at different steps, chunked
prompts, a cached prefix, seeded sampling, overlap scheduling on and off, page
sizes 1 and 16, on a tiny random Llama and on SmolLM2; the KV invariant holds
after every step (debug_kv_invariant).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from conftest import track
from helpers import run_staggered
from test_prefix_cache import shared_prefix_workload

from engine.engine import Engine
from engine.sampling_params import SamplingParams


def tiny(path: str, **options: object) -> Engine:
    kwargs = dict(
        device="cpu",
        dtype="float32",
        disable_graphs=True,
        kv_cache_tokens=4096,
        max_num_seqs=8,
        debug_kv_invariant=True,
        max_extend_step_ms=0,
        chunked_prefill_size=64,
    )
    kwargs.update(options)
    return track(Engine(model=path, **kwargs))


@pytest.mark.parametrize("page_size,overlap", [(1, False), (16, False), (16, True)])
def test_mixed_steps_give_the_tokens_of_separate_steps(
    tiny_checkpoints: dict[str, str], page_size: int, overlap: bool
) -> None:
    path = tiny_checkpoints["llama"]
    separate = tiny(path, page_size=page_size, mixed_steps=False, overlap_schedule=overlap)
    mixed = tiny(path, page_size=page_size, mixed_steps=True, overlap_schedule=overlap)
    prompts, arrivals = shared_prefix_workload(separate.model_config.vocab_size, num_requests=24)
    rng = random.Random(1)
    prompts[5] = [rng.randrange(3, 300) for _ in range(300)]  # chunked: 5 steps of 64 tokens
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = run_staggered(separate, prompts, params, arrivals)
    got = run_staggered(mixed, prompts, params, arrivals)
    assert got.token_ids == want.token_ids
    recorder = got.recorder
    mixed_steps = [n for (is_decode, _), n in zip(recorder.steps, recorder.num_decodes) if not is_decode and n > 0]
    assert len(mixed_steps) >= 5, "decodes never shared a step with a prefill"
    assert mixed.stats().prefix_cache_hit_tokens > 0  # cached prefixes were reused inside mixed steps


def test_mixed_steps_keep_seeded_sampling_and_stops(tiny_checkpoints: dict[str, str]) -> None:
    """Seeded draws, stop ids and max_tokens in mixed steps: the same as in separate steps."""
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 90))] for _ in range(10)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(5, 30),
            temperature=0.9,
            top_p=0.9,
            seed=i,
            ignore_eos=True,
            stop_token_ids=[7] if i % 3 == 0 else [],
        )
        for i in range(len(prompts))
    ]
    arrivals = [0, 0, 1, 2, 2, 5, 8, 9, 13, 20]

    def run(engine: Engine) -> list[list[int]]:
        return run_staggered(engine, prompts, params, arrivals).token_ids

    assert run(tiny(path, mixed_steps=True, chunked_prefill_size=32)) == run(
        tiny(path, mixed_steps=False, chunked_prefill_size=32)
    )


def test_mixed_steps_under_memory_pressure_retract_and_match(tiny_checkpoints: dict[str, str]) -> None:
    path = tiny_checkpoints["llama"]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = tiny(path, page_size=16, mixed_steps=False)
    tight = tiny(path, page_size=16, mixed_steps=True, kv_cache_tokens=112)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.stats().num_retractions > 0


def test_smollm2_mixed_steps_match_separate(engine_cache: Callable[..., Engine]) -> None:
    """The real model: a long prompt arriving while others decode, mixed vs separate steps."""
    separate = engine_cache(None, mixed_steps=False, chunked_prefill_size=48)
    mixed = engine_cache(None, mixed_steps=True, chunked_prefill_size=48)
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers: " * 6]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    arrivals = [0, 2, 4]
    assert (
        run_staggered(mixed, prompts, params, arrivals).token_ids
        == run_staggered(separate, prompts, params, arrivals).token_ids
    )


@pytest.mark.parametrize("name,mixed", [("llama", False), ("llama", True), ("gemma2", True)])
def test_compiled_extend_steps_match_eager_and_compile_once(
    tiny_checkpoints: dict[str, str], name: str, mixed: bool
) -> None:
    """compile_extend: prefill, chunk and mixed steps of every size through one compiled layer graph
    (Gemma 2: one per layer kind, sliding and full attention), with the tokens of eager steps."""
    path = tiny_checkpoints[name]
    eager = tiny(path, mixed_steps=mixed, chunked_prefill_size=48)
    compiled = tiny(
        path,
        mixed_steps=mixed,
        chunked_prefill_size=48,
        compile_extend=True,
        disable_graphs=False,
        capture_sizes=[1, 2, 4, 8],
    )
    assert compiled.runner.extend_step is not None
    prompts, arrivals = shared_prefix_workload(eager.model_config.vocab_size, num_requests=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = run_staggered(eager, prompts, params, arrivals)
    got = run_staggered(compiled, prompts, params, arrivals)
    assert got.token_ids == want.token_ids
    extend_sizes = {size for is_decode, size in got.recorder.steps if not is_decode}
    assert len(extend_sizes) > 3  # many step sizes went through the one graph
    assert compiled.runner.extend_step.compiled and compiled.runner.extend_step.compiles_after_first == 0


def test_strict_mode_never_recompiles_over_a_long_mixed_workload(tiny_checkpoints: dict[str, str]) -> None:
    """Decode graphs per batch size and the one compiled extend step: over ~400 steps of staggered
    arrivals (every batch size, prompt length and chunk split), nothing compiles after warm-up;
    strict mode would raise if it did."""
    engine = tiny(
        tiny_checkpoints["llama"],
        mixed_steps=True,
        compile_extend=True,
        disable_graphs=False,
        strict_graphs=True,
        capture_sizes=[1, 2, 4, 8],
        chunked_prefill_size=40,
    )
    rng = random.Random(7)
    arrivals = sorted(rng.randrange(0, 420) for _ in range(70))
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 120))] for _ in arrivals]
    params = [SamplingParams(max_tokens=rng.randint(2, 40), temperature=0.0, ignore_eos=True) for _ in prompts]
    run = run_staggered(engine, prompts, params, arrivals, max_steps=500)
    assert len(run.recorder.steps) >= 300  # steps that ran (idle steps between arrivals schedule nothing)
    assert engine.runner.graph_runner.compiles_after_warmup == 0
    extend = engine.runner.extend_step
    assert extend.compiled and extend.compiles_after_first == 0


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_steps_above_the_graphs_run_the_compiled_step(tiny_checkpoints: dict[str, str], mixed: bool) -> None:
    """max_num_seqs above the largest capture size (a tuned config's sizes, or --max-num-seqs past them):
    the larger decode steps run the compiled layers without a graph, never eagerly, with the tokens of eager
    steps, and in strict mode nothing compiles for them."""
    path = tiny_checkpoints["llama"]
    options = dict(mixed_steps=mixed, chunked_prefill_size=48, max_num_seqs=6)
    eager = tiny(path, **options)
    compiled = tiny(
        path, **options, compile_extend=True, disable_graphs=False, strict_graphs=True, capture_sizes=[1, 2]
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 60))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(6, 20), temperature=0.0, ignore_eos=True) for _ in prompts]
    arrivals = [0, 0, 0, 1, 1, 2, 3, 9, 12, 15]
    want = run_staggered(eager, prompts, params, arrivals)
    got = run_staggered(compiled, prompts, params, arrivals)
    assert got.token_ids == want.token_ids
    assert max(got.decode_sizes) > 2  # decode steps the graphs cannot hold ran
    runner = compiled.runner
    assert runner.eager_steps == 0
    assert runner.graph_steps == sum(1 for size in got.decode_sizes if size <= 2)
    assert runner.extend_step.compiled and runner.extend_step.compiles_after_first == 0
    assert runner.graph_runner.compiles_after_warmup == 0
