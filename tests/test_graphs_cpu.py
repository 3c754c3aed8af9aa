"""CPU compiled decode (torch.compile, dynamic=False): same tokens as eager, no recompiles.

Capture sizes 1,2,4: batches of 1, 2 and 4 replay their own entry, a batch of 3 is padded to
4 (the padded row writes to the reserved page 0 and its logits are sliced away).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from conftest import track
from helpers import StepRecorder, get_engine, greedy

from engine.engine import Engine
from graphs.compiled_runner import compile_count

SMOL_PROMPTS = [
    "The capital of France is",
    "Here is a list of three fruits:",
    "Once upon a time, in a small village at the foot of a mountain, there lived an old clockmaker who",
    "Question: what is 12 plus 30? Answer:",
]
DECODE_TOKENS = 16


def tiny_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (5, 16, 29, 2)]


@pytest.mark.parametrize(
    "model_name,batch,page_size,loop",
    [
        *((name, batch, page, "sync") for name in ("smollm2", "qwen3") for batch in (1, 3, 4) for page in (1, 16)),
        # The fallbacks inside the compiled graphs: the same tokens as the eager fallbacks.
        ("qwen3", 3, 16, "fast-paths-off"),
    ],
)
def test_compiled_decode_matches_eager(
    request: pytest.FixtureRequest,
    engine_cache: Callable[..., Engine],
    tiny_checkpoints: dict[str, str],
    model_name: str,
    batch: int,
    page_size: int,
    loop: str,
) -> None:
    if loop == "fast-paths-off":
        request.getfixturevalue("cpu_fast_paths_off")
    model = None if model_name == "smollm2" else tiny_checkpoints[model_name]
    graphs = get_engine(engine_cache, model, "graphs", page_size)
    eager = get_engine(engine_cache, model, "eager", page_size)
    prompts = SMOL_PROMPTS if model is None else tiny_prompts(graphs.model_config.vocab_size)
    prompts = prompts[:batch]
    params = greedy(DECODE_TOKENS)

    expected = [o.token_ids for o in eager.generate(prompts, params)]
    compiles, graph_steps, eager_steps = compile_count(), graphs.runner.graph_steps, graphs.runner.eager_steps
    got = [o.token_ids for o in graphs.generate(prompts, params)]

    assert got == expected
    # All prompts prefill in one (eager) step, then every decode step is one replay of size `batch`.
    assert graphs.runner.graph_steps - graph_steps == DECODE_TOKENS - 1
    assert graphs.runner.eager_steps - eager_steps == 1
    assert compile_count() == compiles


def test_batches_beyond_the_largest_capture_size_run_eagerly(
    engine_cache: Callable[..., Engine], tiny_checkpoints: dict[str, str]
) -> None:
    model = tiny_checkpoints["qwen3"]
    graphs = engine_cache(model, page_size=16, capture_sizes="1,2,4", max_num_seqs=6, disable_graphs=False)
    eager = engine_cache(model, page_size=16, max_num_seqs=6)
    assert graphs.runner.graph_runner.capture_sizes == [1, 2, 4]
    prompts = [*tiny_prompts(graphs.model_config.vocab_size), [9, 8, 7], [40, 41, 42, 43]]
    params = [greedy(12), greedy(12), greedy(12), greedy(12), greedy(4), greedy(8)]
    graph_steps = graphs.runner.graph_steps
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    # Batches of 6 and 5 ran eagerly; once requests finished, batch 4 went back to the graph.
    assert graphs.runner.graph_steps - graph_steps == 12 - 8


def _serve_with_churn(engine: Engine, vocab_size: int, min_decode_steps: int) -> tuple[dict[str, list[int]], list[int]]:
    """Requests of varying lengths arrive at seeded random steps and finish at different times."""
    rng = random.Random(1234)
    finals: dict[str, list[int]] = {}
    issued = 0
    step = 0
    with StepRecorder(engine) as recorder:
        while len(recorder.decode_sizes) < min_decode_steps or engine.has_unfinished():
            queued = len(engine.scheduler.waiting) + len(engine.scheduler.running)
            if len(recorder.decode_sizes) < min_decode_steps and queued < 5 and rng.random() < 0.3:
                # Mostly short prompts; now and then a long one so page tables grow over many pages.
                length = rng.choice([1, 3, 8, 15, 17, 40, 150])
                prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
                engine.add_request(prompt, greedy(rng.randint(2, 40)), request_id=f"churn-{issued}")
                issued += 1
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output.token_ids
            step += 1
            assert step < 5000
    return finals, recorder.decode_sizes


def test_zero_recompiles_over_200_decode_steps_with_changing_batches(tiny_checkpoints: dict[str, str]) -> None:
    model = tiny_checkpoints["qwen3"]
    options = dict(device="cpu", dtype="float32", page_size=16, kv_cache_tokens=2048, max_num_seqs=4)
    engine = track(Engine(model=model, capture_sizes="1,2,4", strict_graphs=True, **options))
    warm = compile_count()

    finals, sizes = _serve_with_churn(engine, engine.model_config.vocab_size, 200)

    assert len(sizes) >= 200
    assert set(sizes) == {1, 2, 3, 4}, sizes  # batches grew and shrank through every size
    assert compile_count() == warm
    assert engine.runner.graph_runner.compiles_after_warmup == 0
    assert engine.runner.graph_steps == len(sizes)  # every decode step was a replay
    # And the padded replays computed the same tokens as eager decoding of the same schedule.
    eager = track(Engine(model=model, disable_graphs=True, **options))
    expected, eager_sizes = _serve_with_churn(eager, eager.model_config.vocab_size, 200)
    assert eager_sizes == sizes
    assert finals == expected


def test_interleaved_graph_engines_use_their_own_weights_and_shapes(
    engine_cache: Callable[..., Engine], tiny_checkpoints: dict[str, str]
) -> None:
    """Engines share compiled code objects: llama_plain and mistral even have identical shapes."""
    names = ["llama_plain", "mistral", "qwen3"]
    graph_engines = [get_engine(engine_cache, tiny_checkpoints[n], "graphs", 16) for n in names]
    eager_engines = [get_engine(engine_cache, tiny_checkpoints[n], "eager", 16) for n in names]
    prompts = [[5, 6, 7, 8], [100, 3, 77], [12] * 20]
    params = greedy(20)
    ids = [[e.add_request(p, params) for p in prompts] for e in graph_engines]
    finals: list[dict[str, list[int]]] = [{} for _ in names]
    while any(e.has_unfinished() for e in graph_engines):
        for i, engine in enumerate(graph_engines):  # one step of each engine in turn
            for output in engine.step():
                if output.finished:
                    finals[i][output.request_id] = output.token_ids
    for i, eager in enumerate(eager_engines):
        expected = [o.token_ids for o in eager.generate(prompts, params)]
        assert [finals[i][r] for r in ids[i]] == expected, names[i]


def test_strict_engine_survives_another_engine_compiling(tiny_checkpoints: dict[str, str]) -> None:
    """strict_graphs flags recompiles of *this* engine's graphs, not compiles anywhere in the process.

    (Regression: strict mode once compared the process-wide compile counter with a snapshot taken
    at this engine's warm-up, so the first replay after any other engine compiled raised.)
    """
    options = dict(device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_seqs=2, strict_graphs=True)
    first = track(Engine(model=tiny_checkpoints["qwen3"], page_size=16, capture_sizes="1,2", **options))
    params = greedy(6)
    before = first.generate([[1, 2, 3]], params)[0].token_ids
    compiles = compile_count()
    track(Engine(model=tiny_checkpoints["qwen2"], page_size=5, capture_sizes="1", **options))
    assert compile_count() > compiles, "precondition: the second engine compiled something"
    after = first.generate([[1, 2, 3]], params)[0].token_ids
    assert after == before
    assert first.runner.graph_runner.compiles_after_warmup == 0


def test_many_graph_engines_in_one_process(tiny_checkpoints: dict[str, str]) -> None:
    """One process builds graph engines of many shapes (a server switching models, this suite).

    (Regression: all engines once compiled into the same two code objects while the runner only
    raised dynamo's process-wide recompile limit to max(limit, 4 * len(capture_sizes) + 8), so
    with capture sizes "1" the 13th engine of a new shape died with FailOnRecompileLimitHit.)
    """
    import torch._dynamo

    # torch's own default limit, as in any user process. config.patch, never monkeypatch.setattr:
    # pytest's undo of a setattr on torch's config module hides the entry for the rest of the process.
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        # 13 page sizes that no other test uses: every engine compiles a batch-size-1 graph of its own.
        options = dict(device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_seqs=1, capture_sizes="1")
        for page_size in [3, 6, 7, 9, 10, 11, 12, 13, 14, 15, 17, 18, 19]:
            engine = track(Engine(model=tiny_checkpoints["qwen3"], page_size=page_size, **options))
            assert len(engine.generate([[4, 5, 6]], greedy(3))[0].token_ids) == 3
            assert engine.runner.graph_steps == 2


@pytest.mark.parametrize("dynamic_batch", [False, True])
def test_a_dynamic_batch_compiles_each_piece_twice_not_three_times(tiny_llama: str, dynamic_batch: bool) -> None:
    """The CUDA runner's compiled step (dynamic=None), captured largest size first: marked dynamic from the
    first call, every size above 1 shares the first compile and size 1 gets its own (two per piece, layer
    and head); left to dynamo's automatic dynamic shapes the first size compiled static, the second again
    dynamic (three). Counted with dynamo's eager backend: the frames are the same whatever the backend."""
    from graphs.compiled_step import CompiledDecodeStep, compile_count
    from graphs.static_buffers import StaticDecodeBuffers

    engine = track(
        Engine(model=tiny_llama, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256, warmup=False)
    )
    step = CompiledDecodeStep(
        engine.model, engine.kv_pool.caches, dynamic=None, backend="eager", max_entries=16, dynamic_batch=dynamic_batch
    )
    buffers = StaticDecodeBuffers.allocate(8, 4, engine.kv_pool.page_size, torch.device("cpu"), torch.int64)
    before = compile_count()
    outputs = {}
    with torch.no_grad():
        for bs in (8, 4, 2, 1):  # largest first, as capture runs
            outputs[bs] = step(buffers.input_ids[:bs], buffers.positions[:bs], buffers.metadata(bs))
    assert compile_count() - before == (4 if dynamic_batch else 6)
    for bs, logits in outputs.items():
        torch.testing.assert_close(logits, outputs[8][:bs])  # the same dummy rows give the same logits


def test_decode_with_opaque_attention_shares_the_extend_steps_layer_graph(tiny_llama: str) -> None:
    """The CUDA runner's compiled decode step (opaque attention, eager head) runs the extend step's compiled
    layer function: decode sizes 8, 4, 2 compile it once, an extend step of 24 tokens after them compiles
    nothing, and both give what the uncompiled model gives. Counted with dynamo's eager backend."""
    from engine.layers.attention import step_context
    from engine.tuning.extend import prompt_batch
    from graphs.compiled_extend import CompiledExtendStep
    from graphs.compiled_step import CompiledDecodeStep, compile_count
    from graphs.static_buffers import StaticDecodeBuffers

    engine = track(
        Engine(model=tiny_llama, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256, warmup=False)
    )
    extend = CompiledExtendStep(engine.model, engine.kv_pool.caches, backend="eager")
    decode = CompiledDecodeStep(
        engine.model,
        engine.kv_pool.caches,
        dynamic=None,
        backend="eager",
        max_entries=16,
        dynamic_batch=True,
        opaque_attention=True,
        layer_fn=extend.layer_fn,
        compile_head=False,
    )
    reference = CompiledDecodeStep(
        engine.model, engine.kv_pool.caches, dynamic=None, backend="eager", max_entries=16, dynamic_batch=True
    )
    buffers = StaticDecodeBuffers.allocate(8, 4, engine.kv_pool.page_size, torch.device("cpu"), torch.int64)
    buffers.input_ids.copy_(torch.arange(3, 11))
    sizes = (8, 4, 2)  # largest first, as capture runs
    with torch.no_grad():
        expected_logits = {
            bs: reference(buffers.input_ids[:bs], buffers.positions[:bs], buffers.metadata(bs)) for bs in sizes
        }
        before = compile_count()
        for bs in sizes:
            out = torch.full((bs, engine.model_config.vocab_size), float("nan"))
            logits = decode.logits(
                decode.hidden_states(buffers.input_ids[:bs], buffers.positions[:bs], buffers.metadata(bs)), out
            )
            assert logits is out
            torch.testing.assert_close(out, expected_logits[bs])
        assert compile_count() - before == 1  # one layer graph; the head ran eagerly
        batch = prompt_batch(engine, 24, 10)
        hidden = extend(batch.input_ids, batch.positions, batch.meta)
        assert compile_count() - before == 1 and extend.compiled
        with step_context(engine.model.attention_backend, batch.meta):
            expected = engine.model(batch.input_ids, batch.positions, engine.kv_pool.caches, batch.meta)
    torch.testing.assert_close(hidden, expected)
