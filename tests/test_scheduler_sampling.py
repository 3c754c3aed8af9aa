"""Continuous batching, stop conditions, preemption and per-request sampling.

Most tests run the tiny random Qwen3 checkpoint eagerly (milliseconds per step); the ones
about text (stop strings, EOS, streaming deltas) run the embedded SmolLM2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import track
from helpers import greedy, hf_greedy, repeats, run_staggered

from engine.engine import Engine
from engine.sampling_params import SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9],
    [100, 101, 102],
    [17] * 6,
    [300, 20, 41, 7, 99, 3, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19],
]


@pytest.fixture(scope="module")
def tiny(engine_cache: Callable[..., Engine], tiny_checkpoints: dict[str, str]) -> Engine:
    """Tiny Qwen3, eager, page 16, up to 8 sequences."""
    return engine_cache(tiny_checkpoints["qwen3"])


def solo(engine: Engine, prompt: Any, params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0].token_ids


# ---------------------------------------------------------------------------------------------
# Continuous batching
# ---------------------------------------------------------------------------------------------


def test_requests_join_and_leave_the_running_batch(tiny: Engine) -> None:
    params = [greedy(12), greedy(20), greedy(5), greedy(30)]
    run = run_staggered(tiny, PROMPTS, params, arrivals=[0, 3, 6, 6])
    # Each request's tokens are exactly what it gets alone: joining and leaving changes nothing.
    for prompt, p, output in zip(PROMPTS, params, run.outputs):
        assert output.token_ids == solo(tiny, prompt, p)
        assert len(output.token_ids) == p.max_tokens and output.finish_reason == "length"
    sizes = run.decode_sizes
    # Grew 1 -> 2 -> 4 as requests arrived, then shrank to 1 as they finished.
    assert sizes[0] == 1 and 2 in sizes and max(sizes) == 4 and sizes[-1] == 1, sizes
    assert sizes.index(4) < len(sizes) - 1 - sizes[::-1].index(2), sizes


def test_stream_yields_every_token_once(tiny: Engine) -> None:
    params = greedy(9)
    expected = tiny.generate(PROMPTS[:2], params)
    seen: dict[str, list[int]] = {}
    finals = {}
    for output in tiny.stream(PROMPTS[:2], params):
        seen.setdefault(output.request_id, []).extend(output.new_token_ids)
        if output.finished:
            finals[output.request_id] = output
    assert sorted(len(v) for v in seen.values()) == [9, 9]
    assert [finals[r].token_ids for r in finals] == [o.token_ids for o in expected]
    assert [seen[r] for r in finals] == [o.token_ids for o in expected]


def test_abandoned_stream_frees_its_requests(tiny: Engine) -> None:
    stream = tiny.stream(PROMPTS, greedy(40))
    for count, _ in enumerate(stream):
        if count == 6:
            break
    stream.close()  # the generator's cleanup aborts what is still pending
    assert not tiny.has_unfinished()
    tiny.check_kv_invariant()
    assert tiny.kv_pages_in_use() == 0


# ---------------------------------------------------------------------------------------------
# Stop conditions
# ---------------------------------------------------------------------------------------------


def test_max_tokens(tiny: Engine) -> None:
    outputs = tiny.generate(PROMPTS[:3], [greedy(1), greedy(2), greedy(17)])
    assert [len(o.token_ids) for o in outputs] == [1, 2, 17]
    assert all(o.finish_reason == "length" for o in outputs)


def test_stop_token_ids(tiny: Engine) -> None:
    reference = solo(tiny, PROMPTS[0], greedy(24))
    # The first token (from index 3 on) that does not occur earlier in the output.
    index = next(i for i in range(3, len(reference)) if reference[i] not in reference[:i])
    stop_id = reference[index]
    output = tiny.generate([PROMPTS[0]], greedy(24, stop_token_ids=[stop_id]))[0]
    assert output.finish_reason == "stop"
    assert output.token_ids == reference[: index + 1]  # the stop token is the last one returned


def test_stop_on_eos(smol_engine: Engine) -> None:
    prompt = "The capital of France is"
    full = smol_engine.generate([prompt], greedy(64))[0].token_ids
    eos = smol_engine.eos_token_ids
    first = next((i for i, t in enumerate(full) if t in eos), None)
    assert first is not None, "precondition: the greedy continuation reaches EOS within 64 tokens"
    output = smol_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert output.finish_reason == "stop"
    assert output.token_ids == full[: first + 1]
    assert "<|" not in output.text  # special tokens are not in the text


def test_context_length_ends_generation(engine_cache: Callable[..., Engine], tiny_checkpoints: dict[str, str]) -> None:
    engine = engine_cache(tiny_checkpoints["qwen3"], max_model_len=40)
    outputs = engine.generate([list(range(3, 33)), list(range(3, 42)), [7, 8]], greedy(100))
    assert [len(o.token_ids) for o in outputs] == [10, 1, 38]  # every request stops at 40 tokens
    assert all(o.finish_reason == "length" for o in outputs)
    long_engine = engine_cache(tiny_checkpoints["qwen3"])
    assert outputs[0].token_ids == solo(long_engine, list(range(3, 33)), greedy(10))


@pytest.fixture(scope="module")
def smol_text(smol_engine: Engine) -> tuple[str, list[int], str]:
    prompt = "The capital of France is"
    output = smol_engine.generate([prompt], greedy(24))[0]
    return prompt, output.token_ids, output.text


@pytest.mark.parametrize("stops", [["\n\n"], ["answer is"], ["Par"], ["\n\nThe", "zzz-never"], ["answer", "\n"]])
def test_stop_strings_truncate_text(
    smol_engine: Engine, smol_text: tuple[str, list[int], str], stops: list[str]
) -> None:
    prompt, full_tokens, full_text = smol_text
    found = [full_text.find(s) for s in stops if s in full_text]
    assert found, f"precondition: one of {stops} occurs in {full_text!r}"
    cut = min(found)
    output = smol_engine.generate([prompt], greedy(24, stop=stops))[0]
    assert output.finish_reason == "stop"
    assert output.text == full_text[:cut]  # truncated before the (earliest) stop string
    assert output.token_ids == full_tokens[: len(output.token_ids)]
    assert len(output.token_ids) < len(full_tokens)


@pytest.mark.parametrize("stops", [["\n\n"], ["\n\nThe"], ["answer is"]])
def test_streamed_text_deltas_add_up_to_the_final_text(
    smol_engine: Engine, smol_text: tuple[str, list[int], str], stops: list[str]
) -> None:
    """Concatenating new_text of a stream gives the final text, stop strings included.

    Engine bug (stop strings over several tokens): engine/engine.py _append_token streams each
    token's text as soon as it decodes; when a stop string completes, output_text is cut back
    before it, and the final output's new_text is the *whole* truncated text (the startswith
    check fails), so a client concatenating deltas gets the text twice, with the part of the stop
    string that was already streamed in between. A fix holds back text that could still be the
    start of a stop string (vLLM does) and never sends it.
    """
    prompt, _, _full_text = smol_text
    params = greedy(24, stop=stops)
    final = smol_engine.generate([prompt], params)[0].text
    streamed = "".join(output.new_text for output in smol_engine.stream([prompt], params))
    assert streamed == final


# Full-width CJK punctuation on purpose: multibyte characters that a byte-level tokenizer splits.
@pytest.mark.parametrize("prompt", ["日本の首都は", "中文：你好，世界。我"])  # noqa: RUF001
def test_streamed_text_deltas_with_multibyte_characters(smol_engine: Engine, prompt: str) -> None:
    """A character split over several byte-level tokens is streamed once, when it is complete.

    Engine bug: engine/engine.py _append_token decodes all output tokens each step and sends
    the difference to the previous text; while a character is incomplete the decoded text ends
    in U+FFFD, which is streamed, and when the character completes the new text no longer
    starts with the previous one, so the whole text is sent again. Fix: incremental
    detokenization that holds back text ending in an incomplete character (vLLM keeps prefix and
    read offsets) and diffs against what was already sent.
    """
    outputs = list(smol_engine.stream([prompt], greedy(16)))
    final = outputs[-1]
    assert any(ord(c) > 0x2E80 for c in final.text), f"precondition: CJK output, got {final.text!r}"
    assert "".join(o.new_text for o in outputs) == final.text
    assert not any("\ufffd" in o.new_text for o in outputs[:-1])


def test_stop_string_per_request_in_a_batch(smol_engine: Engine, smol_text: tuple[str, list[int], str]) -> None:
    prompt, _, full_text = smol_text
    outputs = smol_engine.generate([prompt, prompt], [greedy(24, stop=["\n"]), greedy(24)])
    assert outputs[0].text == full_text[: full_text.index("\n")]
    assert outputs[1].text == full_text


# ---------------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------------


def run_counting_preemptions(engine: Engine, prompts: list, params: Any) -> tuple[list[list[int]], int]:
    ids = [
        engine.add_request(p, params if isinstance(params, SamplingParams) else params[i])
        for i, p in enumerate(prompts)
    ]
    requests = {rid: engine._requests[rid] for rid in ids}
    finals: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.token_ids
        engine.check_kv_invariant()  # balanced at every step, not only at the end
        steps += 1
        assert steps < 3000, "no progress under preemption"
    return [finals[r] for r in ids], sum(r.num_preemptions for r in requests.values())


@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_keeps_greedy_tokens(tiny: Engine, tiny_checkpoints: dict[str, str], page_size: int) -> None:
    # A 64-token pool for four requests that grow to ~50 tokens each: decode steps run out of
    # pages again and again and the newest request is preempted, then recomputed.
    small = track(
        Engine(
            model=tiny_checkpoints["qwen3"],
            device="cpu",
            dtype="float32",
            disable_graphs=True,
            page_size=page_size,
            kv_cache_tokens=64,
            max_num_seqs=4,
        )
    )
    params = greedy(40)
    got, preemptions = run_counting_preemptions(small, PROMPTS, params)
    assert preemptions > 0
    assert got == [o.token_ids for o in tiny.generate(PROMPTS, params)]


def test_preemption_keeps_seeded_samples(tiny: Engine, tiny_checkpoints: dict[str, str]) -> None:
    small = track(
        Engine(
            model=tiny_checkpoints["qwen3"],
            device="cpu",
            dtype="float32",
            disable_graphs=True,
            page_size=16,
            kv_cache_tokens=64,
            max_num_seqs=4,
        )
    )
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(4)
    ]
    got, preemptions = run_counting_preemptions(small, PROMPTS, params)
    assert preemptions > 0
    assert got == [o.token_ids for o in tiny.generate(PROMPTS, params)]


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def test_seed_reproducible_across_batch_compositions(tiny: Engine) -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=24, ignore_eos=True)
    alone = solo(tiny, PROMPTS[0], target)
    others = [
        SamplingParams(temperature=1.0, max_tokens=30),
        greedy(8),
        SamplingParams(temperature=0.7, seed=7, max_tokens=5),
    ]
    batched = tiny.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]], [others[0], target, others[1], others[2]])
    assert batched[1].token_ids == alone
    # Joining a running batch late, next to other seeded requests, changes nothing either.
    run = run_staggered(tiny, [PROMPTS[3], PROMPTS[0]], [others[2], target], arrivals=[0, 4])
    assert run.outputs[1].token_ids == alone


def test_different_seeds_differ_same_seed_repeats(tiny: Engine) -> None:
    outputs = [
        tuple(solo(tiny, PROMPTS[0], SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)))
        for s in range(4)
    ]
    assert len(set(outputs)) == 4
    again = tuple(solo(tiny, PROMPTS[0], SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True)))
    assert again == outputs[2]
    assert outputs[0] != tuple(solo(tiny, PROMPTS[0], greedy(16)))


@pytest.mark.parametrize(
    "kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k=1", "top_p~0", "min_p=1"]
)
def test_filters_that_keep_one_token_equal_greedy(tiny: Engine, kwargs: dict) -> None:
    expected = [o.token_ids for o in tiny.generate(PROMPTS, greedy(20))]
    params = SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True, **kwargs)
    assert [o.token_ids for o in tiny.generate(PROMPTS, params)] == expected


@pytest.mark.parametrize(
    "kwargs,direction",
    [
        (dict(repetition_penalty=3.0), "fewer"),
        (dict(frequency_penalty=2.0), "fewer"),
        (dict(presence_penalty=2.0), "fewer"),
        (dict(repetition_penalty=0.5), "more"),
        (dict(presence_penalty=-2.0), "more"),
    ],
)
def test_penalties_change_repetition_in_the_expected_direction(tiny: Engine, kwargs: dict, direction: str) -> None:
    plain = sum(repeats(o.token_ids) for o in tiny.generate(PROMPTS, greedy(48)))
    penalised = sum(repeats(o.token_ids) for o in tiny.generate(PROMPTS, greedy(48, **kwargs)))
    assert 0 < plain < 4 * 47  # precondition: greedy repeats some tokens, not only one
    if direction == "fewer":
        assert penalised < plain / 2, (plain, penalised)
    else:
        assert penalised > plain * 1.5, (plain, penalised)


def test_repetition_penalty_matches_hf(tiny: Engine, hf_tiny: Callable[[str], Any]) -> None:
    """HF semantics: every token of prompt or output, once, divided (>0) or multiplied (<0)."""
    model = hf_tiny("qwen3")
    for prompt in PROMPTS[:3]:
        expected = hf_greedy(model, prompt, 24, repetition_penalty=1.3)
        assert expected != hf_greedy(model, prompt, 24)  # precondition: the penalty matters here
        assert solo(tiny, prompt, greedy(24, repetition_penalty=1.3)) == expected


def test_per_request_parameters_inside_one_batch(tiny: Engine) -> None:
    reference = solo(tiny, PROMPTS[0], greedy(24))
    stop_id = next(t for i, t in enumerate(reference) if i >= 2 and t not in reference[:i])
    params = [
        greedy(24),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
        greedy(24, repetition_penalty=2.0),
        greedy(24, stop_token_ids=[stop_id]),
        greedy(3),
        SamplingParams(
            temperature=1.0, top_p=0.5, min_p=0.1, seed=9, max_tokens=24, ignore_eos=True, frequency_penalty=0.5
        ),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    batched = tiny.generate(prompts, params)
    for prompt, p, output in zip(prompts, params, batched):
        assert output.token_ids == solo(tiny, prompt, p), p
    assert batched[4].finish_reason == "stop" and batched[4].token_ids[-1] == stop_id
    assert len(batched[5].token_ids) == 3


def test_presence_and_frequency_penalties_match_a_reference(tiny: Engine, hf_tiny: Callable[[str], Any]) -> None:
    """OpenAI semantics over generated tokens, from the persistent penalty rows, against HF logits by hand;
    the rows are built once per request and kept by diffs, batched beside unpenalized requests."""
    import torch
    from helpers import hf_last_logits

    model = hf_tiny("qwen3")
    frequency, presence = 1.5, 0.7
    prompts, expected = PROMPTS[:3], []
    for prompt in prompts:
        out: list[int] = []
        for _ in range(16):
            logits = hf_last_logits(model, list(prompt) + out).float()
            counts = (
                torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
                if out
                else torch.zeros_like(logits)
            )
            out.append(int((logits - frequency * counts - presence * (counts > 0).float()).argmax()))
        expected.append(out)
    assert expected[0] != solo(tiny, prompts[0], greedy(16))  # precondition: the penalties matter here
    params = [greedy(16, frequency_penalty=frequency, presence_penalty=presence), greedy(16)] * len(prompts)
    batched = tiny.generate([p for p in prompts for _ in range(2)], params)
    for index, prompt in enumerate(prompts):
        assert batched[2 * index].token_ids == expected[index]
        assert batched[2 * index + 1].token_ids == solo(tiny, prompt, greedy(16))
