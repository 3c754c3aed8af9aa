"""One request can never cost another: poisoned sampling values and a failing step (issue: server under attack).

Poisons are refused by validation; values at the edges sample safely; and when a step fails anyway,
the engine re-runs it in parts so that only the culprit fails and every other request gets exactly
the tokens it would have had alone (float32, eager: batch-invariant here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import LOOPS

import graphs.model_runner as model_runner
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

POISONS: list[dict[str, Any]] = [
    {"temperature": math.nan},
    {"temperature": math.inf},
    {"temperature": -1e-300},
    {"top_k": 2**63},
    {"top_k": -2},
    {"top_k": 1.5},
    {"top_k": True},
    {"top_p": math.nan},
    {"top_p": 0.0},
    {"top_p": math.inf},
    {"min_p": math.nan},
    {"min_p": -0.1},
    {"repetition_penalty": math.nan},
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": math.inf},
    {"repetition_penalty": 1e6},
    {"presence_penalty": math.nan},
    {"frequency_penalty": -math.inf},
    {"max_tokens": True},
    {"stop": ["x"] * 100},
    {"stop": ["y" * 5000]},
    {"stop_token_ids": [-1]},
    {"stop_token_ids": [True]},
    {"logprobs": True},
    {"seed": 1.0},
]


@pytest.mark.parametrize("poison", POISONS, ids=lambda p: f"{next(iter(p))}={next(iter(p.values()))!r}"[:40])
def test_poisoned_values_are_refused_naming_the_field(poison: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**poison)
    assert next(iter(poison)) in str(info.value)


# Values that are legal but sit at an edge of float32: each must sample, and as the greedy row does
# where the edge makes it greedy.
EDGES: list[dict[str, Any]] = [
    {"temperature": 1e-37},  # below the greedy threshold: greedy
    {"temperature": 5e-324},
    {"temperature": 0.8, "top_p": 1e-300},  # 0 in float32: only the top token survives
    {"temperature": 0.8, "top_k": 2**31 - 1},  # larger than the vocabulary: clamped
    {"temperature": 0.8, "top_k": 1},
    {"temperature": 1e30},  # flattens the distribution; still a valid draw
    {"temperature": 0.8, "repetition_penalty": 0.01},
    {"temperature": 0.8, "repetition_penalty": 100.0, "min_p": 1.0},
]


def _solo(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("edge", EDGES, ids=lambda e: ",".join(f"{k}={v!r}" for k, v in e.items())[:50])
def test_edge_values_sample_beside_others(smol_engine: Engine, edge: dict[str, Any]) -> None:
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = _solo(smol_engine, prompt, greedy)
    params = [greedy, SamplingParams(max_tokens=6, ignore_eos=True, seed=3, **edge), greedy]
    outputs = smol_engine.generate([prompt] * 3, params)
    assert outputs[0].token_ids == want and outputs[2].token_ids == want
    assert len(outputs[1].token_ids) == 6
    if "top_p" in edge or edge.get("top_k") == 1 or edge.get("temperature", 1.0) < 1e-5:
        assert outputs[1].token_ids == want  # only the argmax could be drawn


PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
    "My favourite food is",
    "In 1969, humans",
    "Water boils at",
    "The quick brown fox",
]


def _params(index: int) -> SamplingParams:
    """Greedy and seeded random rows side by side: rewinding the seeded generators is under test too."""
    if index % 2:
        return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=100 + index)
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("culprit,loop", [(0, "sync"), (5, "sync"), (7, "sync"), (5, "overlap+mixed")])
def test_a_step_that_fails_fails_only_its_culprit(
    engine_cache: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, culprit: int, loop: str
) -> None:
    """8 requests in one batch, one of which makes sampling raise (in prefill, then in decode)."""
    smol_engine = engine_cache(None, **LOOPS[loop])
    solo = [_solo(smol_engine, prompt, _params(i)) for i, prompt in enumerate(PROMPTS)]
    real_sample = model_runner.sample
    poisoned_id = f"poisoned-{culprit}"
    calls = {"failed": 0}

    def sample_that_chokes_on_the_culprit(logits: torch.Tensor, requests: list, *rest: Any) -> list[int]:
        # Fails on the culprit's third token (a decode step), after the others' draws in this call.
        tokens = real_sample(logits, requests, *rest)
        if any(r.request_id == poisoned_id and len(r.output_token_ids) == 2 for r in requests):
            calls["failed"] += 1
            raise RuntimeError("probability tensor contains inf, nan or element < 0")
        return tokens

    monkeypatch.setattr(model_runner, "sample", sample_that_chokes_on_the_culprit)
    ids = [
        smol_engine.add_request(prompt, _params(i), request_id=poisoned_id if i == culprit else None)
        for i, prompt in enumerate(PROMPTS)
    ]
    finals: dict[str, Any] = {}
    while smol_engine.has_unfinished():
        for output in smol_engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert calls["failed"] >= 2  # the whole batch, then each half holding the culprit
    for i, request_id in enumerate(ids):
        if i == culprit:
            assert finals[request_id].finish_reason == "error"
            assert "probability tensor" in finals[request_id].error
            assert finals[request_id].token_ids == solo[i][:2]  # what it had before its failing step
        else:
            assert finals[request_id].error is None
            assert finals[request_id].token_ids == solo[i], f"request {i} changed because of its neighbour"
    smol_engine.check_kv_invariant()
    assert smol_engine.kv_pages_in_use() == 0
