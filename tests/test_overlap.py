"""Overlap scheduling gives exactly the tokens of the synchronous engine.

With overlap on, step N+1 is launched before step N's tokens are read back, so
the host learns of a stop (string, id, EOS, max_tokens) or handles an abort or
a retraction one step late. None of that may show: every request must emit the
very tokens and text of the synchronous run and nothing past its stop, and the
KV pool invariant must hold after every step (debug_kv_invariant). Float32, CPU:
overlap changes no arithmetic, so the comparison is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import track

from engine.engine import Engine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Hello, my name is",
    "List three colors:",
]


@pytest.fixture(scope="module")
def overlapped(engine_cache: Callable[..., Engine]) -> Engine:
    return engine_cache(None, overlap_schedule=True, debug_kv_invariant=True)


@pytest.fixture(scope="module")
def synchronous(engine_cache: Callable[..., Engine]) -> Engine:
    return engine_cache(None, overlap_schedule=False, debug_kv_invariant=True)


def _summary(output: RequestOutput) -> tuple[Any, ...]:
    logprobs = [(entry.token_id, entry.logprob, entry.top) for entry in output.logprobs or []]
    return output.token_ids, output.text, output.finish_reason, logprobs


def _streamed(engine: Engine, params: list[SamplingParams]) -> tuple[list[tuple[Any, ...]], int]:
    """Each request's final output, checked against its deltas; and how many steps left one in flight."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(PROMPTS, params)]
    finals: dict[str, RequestOutput] = {}
    deltas: dict[str, list[int]] = {request_id: [] for request_id in ids}
    texts: dict[str, str] = dict.fromkeys(ids, "")
    overlapped_steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id not in finals, "a token after the request finished"
            deltas[output.request_id] += output.new_token_ids
            texts[output.request_id] += output.new_text
            if output.finished:
                finals[output.request_id] = output
        overlapped_steps += engine._in_flight is not None
    for request_id in ids:
        assert deltas[request_id] == finals[request_id].token_ids and texts[request_id] == finals[request_id].text
    assert engine.kv_pages_in_use() == 0 and engine.step_builder.rows_in_use == 0
    return [_summary(finals[request_id]) for request_id in ids], overlapped_steps


def test_stops_lengths_and_sampling_match_the_synchronous_run(overlapped: Engine, synchronous: Engine) -> None:
    probe = synchronous.generate([PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_id = probe.token_ids[5]  # a token the greedy run produces: generation stops on it
    params = [
        SamplingParams(max_tokens=64, temperature=0.0),  # until EOS (or 64)
        SamplingParams(max_tokens=40, temperature=0.0, stop=[" sea", "\n\n"]),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.2, seed=7, logprobs=3),
        SamplingParams(max_tokens=1, temperature=0.0),  # its only token comes from the prefill
    ]
    want, synchronous_in_flight = _streamed(synchronous, params)
    got, overlapped_in_flight = _streamed(overlapped, params)
    assert got == want
    assert synchronous_in_flight == 0 and overlapped_in_flight > 10  # it really ran a step ahead
    reasons = [summary[2] for summary in got]
    assert reasons[2] == "stop" and reasons[3] == "length" and reasons[4] == "length"
    assert got[2][0][-1] == stop_id


def test_aborts_stop_at_the_last_token_seen(overlapped: Engine, synchronous: Engine) -> None:
    """Aborted after its third token: that is all it emits, though its fourth was already on the device."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = {prompt: out.token_ids for prompt, out in zip(PROMPTS, synchronous.generate(PROMPTS, params))}
    for engine in (synchronous, overlapped):
        ids = {engine.add_request(prompt, params): prompt for prompt in PROMPTS}
        victim = next(iter(ids))
        emitted: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while engine.has_unfinished():
            for output in engine.step():
                assert output.request_id != victim or len(emitted[victim]) < 3, "a token after the abort"
                emitted[output.request_id] += output.new_token_ids
            if len(emitted[victim]) == 3 and victim in engine._requests:
                engine.abort(victim)
        assert emitted[victim] == full[ids[victim]][:3]
        assert all(emitted[r] == full[ids[r]] for r in ids if r != victim)
        assert engine.kv_pages_in_use() == 0 and engine.step_builder.rows_in_use == 0


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_retraction_under_overlap_keeps_the_tokens(tiny_checkpoints: dict[str, str], seeded: bool) -> None:
    """A 64-token pool for four growing requests: retractions happen with a token still pending."""
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102], [17] * 6, [300, 20, 41, 7, 99, 3, 3, 250, 11, 12, 13]]
    if seeded:
        params = [
            SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(4)
        ]
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    results = []
    for overlap in (False, True):
        engine = track(
            Engine(
                model=tiny_checkpoints["qwen3"],
                device="cpu",
                dtype="float32",
                disable_graphs=True,
                page_size=16,
                kv_cache_tokens=64,
                max_num_seqs=4,
                overlap_schedule=overlap,
                debug_kv_invariant=True,
            )
        )
        outputs = engine.generate(prompts, params)
        assert engine.scheduler.num_retractions > 0
        results.append([o.token_ids for o in outputs])
    assert results[0] == results[1]
