"""Prefix caching, chunked prefill and memory pressure, end to end on real (tiny and SmolLM2) models.

Every check compares token ids with a run that does not use the feature under
test: the prefix cache on vs off, chunked vs whole prefill, a pool too small
for the batch vs an unconstrained one. Engines run with the KV invariant
checked after every step (debug_kv_invariant).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from conftest import build_tiny_checkpoint, track
from helpers import LOOPS, StepRecorder

from engine.engine import Engine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def shared_prefix_workload(vocab: int, num_requests: int = 54, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts = one of three long shared prefixes + a short own suffix; arrival step of each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(length)] for length in (96, 130, 70)]
    prompts = [
        prefixes[i % 3] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))] for i in range(num_requests)
    ]
    prompts.append(list(prefixes[0]))  # a prompt that is exactly a cached prefix: one token still runs
    # Waves: some arrive together (in one prefill), the rest while others decode or after they finish.
    arrivals = [0] * 6 + [3 * (i // 4) + 1 for i in range(len(prompts) - 6)]
    return prompts, arrivals


def run_arrivals(
    engine: Engine, prompts: list[list[int]], arrivals: list[int], params: SamplingParams
) -> list[RequestOutput]:
    index_of: dict[str, int] = {}
    finals: dict[int, RequestOutput] = {}
    step = 0
    while len(finals) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                index_of[engine.add_request(prompts[i], params)] = i
        for output in engine.step():
            if output.finished:
                finals[index_of[output.request_id]] = output
        step += 1
        assert step < 5000, "requests did not finish"
    return [finals[i] for i in range(len(prompts))]


def tiny_engine(path: str, **options: Any) -> Engine:
    # No extend-step time budget (max_extend_step_ms=0): these tests count steps, which must not depend on
    # how fast this machine is (as the shared engines of conftest.py).
    kwargs = dict(
        device="cpu",
        dtype="float32",
        disable_graphs=True,
        kv_cache_tokens=4096,
        max_num_seqs=8,
        debug_kv_invariant=True,
        max_extend_step_ms=0,
    )
    return track(Engine(model=path, **{**kwargs, **options}))


@pytest.mark.parametrize("page_size,loop", [(1, "sync"), (16, "sync"), (16, "overlap+mixed")])
def test_prefix_cache_gives_identical_tokens_and_less_prefill(
    tiny_checkpoints: dict[str, str], page_size: int, loop: str
) -> None:
    path = tiny_checkpoints["llama"]
    cached = tiny_engine(path, page_size=page_size, **LOOPS[loop])
    plain = tiny_engine(path, page_size=page_size, enable_prefix_caching=False, **LOOPS[loop])
    prompts, arrivals = shared_prefix_workload(cached.model_config.vocab_size)
    with_cache = run_arrivals(cached, prompts, arrivals, GREEDY)
    without = run_arrivals(plain, prompts, arrivals, GREEDY)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]

    on, off = cached.stats(), plain.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    assert off.prefill_computed_tokens == prompt_tokens and off.prefix_cache_hit_tokens == 0
    # Served from cache + computed = every prompt token, and most of the shared prefixes were reused.
    assert on.prefix_cache_hit_tokens + on.prefill_computed_tokens == prompt_tokens
    assert on.prefill_computed_tokens < 0.45 * prompt_tokens, (on.prefill_computed_tokens, prompt_tokens)
    assert on.prefix_cache_hit_tokens % page_size == 0
    print(
        f"page {page_size}: {prompt_tokens} prompt tokens, computed {on.prefill_computed_tokens} with the cache "
        f"({100 * on.prefix_cache_hit_rate:.0f}% hit) vs {off.prefill_computed_tokens} without"
    )
    # Idle: nothing held, the cached pages are evictable.
    assert cached.kv_pages_in_use() == 0 and on.kv_pages_cached > 0


def test_requests_arriving_together_share_the_prefix_computed_first(tiny_checkpoints: dict[str, str]) -> None:
    """Eight requests with one long common prefix, added at once: the prefix runs once, not eight times."""
    engine = tiny_engine(tiny_checkpoints["qwen3"], page_size=16)
    rng = random.Random(1)
    prefix = [rng.randrange(3, 300) for _ in range(160)]
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(5)] for _ in range(8)]
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats().prefill_computed_tokens <= 160 + 8 * 5 + 8 * 16  # at most a page of the prefix again each
    alone = tiny_engine(tiny_checkpoints["qwen3"], page_size=16, enable_prefix_caching=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone.generate(prompts, GREEDY)]


def test_smollm2_chat_requests_share_a_system_prompt(engine_cache: Callable[..., Engine]) -> None:
    """SmolLM2 (float32): chat turns behind one system prompt, cache on vs off, token for token."""
    system = {
        "role": "system",
        "content": "You are a concise assistant. Answer in one short sentence, in plain English.",
    }
    questions = [
        "What is the capital of France?",
        "Name a prime number.",
        "What colour is the sky?",
        "Who wrote Hamlet?",
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    cached = engine_cache(None)
    plain = engine_cache(None, enable_prefix_caching=False)
    conversations = [
        cached.tokenizer.apply_chat_template(
            [system, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    conversations = [
        list(c["input_ids"]) if isinstance(c, dict) or hasattr(c, "keys") else list(c) for c in conversations
    ]
    before = cached.stats()
    first = cached.generate(conversations[:1], params)
    rest = cached.generate(conversations[1:], params)
    hits = cached.stats().prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    assert hits >= 3 * 16  # the later three reuse at least the system prompt's full pages
    reference = plain.generate(conversations, params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in reference]


# ---------------------------------------------------------------------------------------------
# Chunked prefill
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(
        "llama_plain", str(tmp_path_factory.mktemp("long") / "llama"), max_position_embeddings=4096
    )


def test_chunked_prefill_matches_whole_prefill_on_a_long_prompt(long_context_model: str) -> None:
    rng = random.Random(2)
    long_prompt = [rng.randrange(3, 300) for _ in range(3000)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    whole = tiny_engine(long_context_model, page_size=16, max_model_len=4096, chunked_prefill_size=0)
    chunked = tiny_engine(long_context_model, page_size=16, max_model_len=4096, chunked_prefill_size=256)
    with StepRecorder(chunked) as recorder:
        got = chunked.generate([long_prompt], params)[0].token_ids
    assert got == whole.generate([long_prompt], params)[0].token_ids
    extends = recorder.extend_sizes
    assert len(extends) == -(-3000 // 256)  # 12 chunks of at most 256 tokens


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_runs_between_the_chunks_of_a_long_prompt(long_context_model: str, mixed: bool) -> None:
    """A short request keeps decoding while a long prompt is prefilled chunk by chunk: in a decode
    step after every chunk, or (mixed steps) in the very step of every chunk."""
    engine = tiny_engine(
        long_context_model, page_size=16, max_model_len=4096, chunked_prefill_size=256, mixed_steps=mixed
    )
    rng = random.Random(3)
    short_id = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()  # the short prompt's prefill
    long_id = engine.add_request(
        [rng.randrange(3, 300) for _ in range(2000)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    kinds = []
    tokens_of: dict[str, int] = {short_id: 1, long_id: 0}
    with StepRecorder(engine) as recorder:
        while engine.has_unfinished():
            for output in engine.step():
                tokens_of[output.request_id] = len(output.token_ids)
        kinds = [is_decode for is_decode, _ in recorder.steps]
    assert tokens_of == {short_id: 20, long_id: 4}
    if mixed:
        # 8 chunk steps, each carrying the short request's decode (256 - 1 prompt tokens each but the last).
        chunk_steps = [i for i, is_decode in enumerate(kinds) if not is_decode]
        assert len(chunk_steps) == 8 and all(recorder.num_decodes[i] == 1 for i in chunk_steps)
        assert chunk_steps == list(range(chunk_steps[0], chunk_steps[0] + 8))  # back to back: nobody waits
        return
    first_chunk = kinds.index(False)
    last_chunk = len(kinds) - 1 - kinds[::-1].index(False)
    between = kinds[first_chunk : last_chunk + 1]
    # 8 chunks, and a decode step after every chunk but the last: the short request never waits long.
    assert between.count(False) == 8 and all(between[i] for i in range(1, len(between), 2))


# ---------------------------------------------------------------------------------------------
# Memory pressure
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "page_size,prefix_cache,loop",
    [(1, True, "sync"), (16, True, "sync"), (16, False, "sync"), (16, True, "overlap+mixed")],
)
def test_tight_pool_retracts_and_still_gives_the_same_tokens(
    tiny_checkpoints: dict[str, str], page_size: int, prefix_cache: bool, loop: str
) -> None:
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(20, 48), temperature=0.0, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)  # seeded sampling survives too
    roomy = tiny_engine(path, page_size=page_size, enable_prefix_caching=prefix_cache)
    tight = tiny_engine(
        path, page_size=page_size, kv_cache_tokens=96, enable_prefix_caching=prefix_cache, **LOOPS[loop]
    )
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert [o.token_ids for o in got] == expected
    assert all(o.finish_reason == "length" for o in got)
    assert tight.stats().num_retractions > 0
    assert roomy.stats().num_retractions == 0
    assert tight.kv_pages_in_use() == 0


def test_debug_invariant_raises_with_the_numbers(tiny_checkpoints: dict[str, str]) -> None:
    engine = tiny_engine(tiny_checkpoints["qwen3"], page_size=16, kv_cache_tokens=256)
    engine.generate([[5, 6, 7] * 10], GREEDY)
    leaked = engine.kv_pool.allocator.allocate("nobody-frees-this", 1)
    engine.kv_pool.allocator._owned.pop("nobody-frees-this")  # a page that left the free list and no one holds
    with pytest.raises(AssertionError, match=r"free \d+ \+ evictable \d+ \+ protected \d+ \+ in use \d+ != total"):
        engine.check_kv_invariant()
    engine.kv_pool.allocator.release(leaked)
    engine.check_kv_invariant()


def test_prompt_that_cannot_fit_the_pool_is_refused_clearly(tiny_checkpoints: dict[str, str]) -> None:
    engine = tiny_engine(tiny_checkpoints["qwen3"], page_size=16, kv_cache_tokens=64)
    with pytest.raises(Exception, match="context length is 64 \\(lowered to the KV pool's 64 tokens\\)"):
        engine.add_request(list(range(3, 100)), GREEDY)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("page_size,length", [(1, 40), (16, 32), (16, 40)])
def test_identical_prompts_take_two_prefill_steps(
    tiny_checkpoints: dict[str, str], page_size: int, length: int
) -> None:
    """n copies of one prompt (parallel sampling): the first computes it, the rest reuse it one step later."""
    engine = tiny_engine(tiny_checkpoints["qwen3"], page_size=page_size)
    prompt = [7 + i % 50 for i in range(length)]
    with StepRecorder(engine) as recorder:
        outputs = engine.generate([prompt] * 8, GREEDY)
    assert len({tuple(o.token_ids) for o in outputs}) == 1
    extends = recorder.extend_sizes
    assert extends == [1, 7]
    reused = (length - 1) // page_size * page_size
    assert engine.stats().prefill_computed_tokens == length + 7 * (length - reused)


def test_prompt_logprobs_requests_are_not_held_back(tiny_checkpoints: dict[str, str]) -> None:
    """They never reuse the cache, so waiting for a shared prefix would gain nothing."""
    engine = tiny_engine(tiny_checkpoints["qwen3"], page_size=16)
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    with StepRecorder(engine) as recorder:
        outputs = engine.generate([prompt] * 3, params)
    assert recorder.extend_sizes == [3]
    assert engine.stats().prefill_computed_tokens == 3 * len(prompt)
    assert all(len(o.prompt_logprobs) == len(prompt) for o in outputs)


def test_prompt_logprobs_match_transformers_across_chunks(
    tiny_checkpoints: dict[str, str], hf_tiny: Callable[[str], Any]
) -> None:
    """Echo scoring: every prompt token's logprob (and top-2), computed over 3 chunks, equals HF's."""
    import torch

    prompt = [(7 * i) % 300 + 3 for i in range(70)]
    engine = tiny_engine(tiny_checkpoints["qwen3"], page_size=16, chunked_prefill_size=32)
    output = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    with torch.no_grad():
        logits = hf_tiny("qwen3")(torch.tensor([prompt])).logits[0].float()
    expected = logits.log_softmax(-1)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - float(expected[position - 1, prompt[position]])) < 1e-4
        assert [t for t, _ in entry.top] == expected[position - 1].topk(2).indices.tolist()
