"""logit_bias, min_tokens and allowed_token_ids on the real engine (SmolLM2, CPU), both step loops."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from helpers import LOOPS

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.server.app import build_app


@pytest.fixture(params=list(LOOPS))
def engine(request: pytest.FixtureRequest, engine_cache: Callable[..., Engine]) -> Engine:
    return engine_cache(None, **LOOPS[request.param])


def test_logit_bias_forces_and_forbids_tokens(engine: Engine) -> None:
    prompt = "The capital of France is"
    plain = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    forced = engine.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={1234: 100.0})
    )[0].token_ids
    assert forced == [1234] * 6
    banned = set(plain)
    avoided = engine.generate(
        [prompt],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=dict.fromkeys(banned, -100.0)),
    )[0].token_ids
    assert not banned & set(avoided)
    sampled = engine.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True, logit_bias={77: 100.0})
            for s in range(3)
        ],
    )
    assert all(o.token_ids == [77] * 6 for o in sampled)  # +100 outweighs any logit at temperature 1


def test_min_tokens_holds_off_eos_and_stop_strings(engine: Engine) -> None:
    prompt = "Say just the word yes."
    short = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0), chat=True)[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20  # EOS comes early on its own
    held = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, min_tokens=20), chat=True)[0]
    assert len(held.token_ids) >= 20 and not set(held.token_ids[:20]) & engine.eos_token_ids
    assert held.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # the same text until the EOS
    stop_at = short.text[:2]
    cut = engine.generate(
        [prompt], SamplingParams(max_tokens=64, temperature=0.0, min_tokens=8, stop=[stop_at]), chat=True
    )[0]
    assert len(cut.token_ids) >= 8  # the stop string at the start did not end it before 8 tokens
    assert engine.kv_pages_in_use() == 0


def test_allowed_token_ids_are_the_only_tokens_sampled(engine: Engine) -> None:
    allowed = [1000, 2000, 3000, 4000]  # rare tokens alike: the draws among them differ
    outputs = engine.generate(
        ["Once upon a time"] * 3,
        [
            SamplingParams(max_tokens=8, temperature=t, seed=s, ignore_eos=True, allowed_token_ids=allowed)
            for t, s in ((0.0, None), (1.0, 1), (1.5, 2))
        ],
    )
    assert all(set(o.token_ids) <= set(allowed) for o in outputs)
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # sampling still samples, among those


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(min_tokens=-2), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    ],
)
def test_bad_values_are_refused_by_name(params: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**params)


def test_both_through_the_server(smol_engine: Engine) -> None:
    with TestClient(build_app(smol_engine)) as http:
        body = http.post(
            "/v1/completions",
            json={
                "prompt": "Hello",
                "max_tokens": 4,
                "temperature": 0,
                "logit_bias": {"1234": 100},
                "return_token_ids": True,
            },
        ).json()
        assert body["choices"][0]["token_ids"] == [1234] * 4
        body = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Say just the word yes."}],
                "max_tokens": 40,
                "temperature": 0,
                "min_tokens": 15,
            },
        ).json()
        assert body["usage"]["completion_tokens"] >= 15
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        smol_engine.add_request("Hi", SamplingParams(logit_bias={10**7: 1.0}))
    assert smol_engine.kv_pages_in_use() == 0
