"""Bad input gets a 4xx in OpenAI's error shape, never a 500, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_helpers import MODEL, ServerProcess, shared_server

from engine.engine import Engine
from engine.server.app import build_app

LONG_PROMPT = "hello " * 2100  # more tokens than the 2048-token context
MSG = [{"role": "user", "content": "hi"}]

# (name, method, path, body (dict -> JSON, str -> raw bytes, None -> no body), expected status)
CASES: list[tuple[str, str, str, Any, int]] = [
    ("not json", "POST", "/v1/completions", "{bad json", 400),
    ("truncated json", "POST", "/v1/completions", '{"prompt": "hi"', 400),
    ("json array body", "POST", "/v1/completions", "[1, 2]", 400),
    ("empty body", "POST", "/v1/completions", "", 400),
    ("json string body", "POST", "/v1/chat/completions", '"hello"', 400),
    ("missing prompt", "POST", "/v1/completions", {"model": MODEL}, 400),
    ("prompt is a number", "POST", "/v1/completions", {"prompt": 5}, 400),
    ("prompt is a dict", "POST", "/v1/completions", {"prompt": {"a": 1}}, 400),
    ("empty prompt string", "POST", "/v1/completions", {"prompt": ""}, 400),
    ("empty prompt list", "POST", "/v1/completions", {"prompt": []}, 400),
    ("negative token id", "POST", "/v1/completions", {"prompt": [1, -5]}, 400),
    ("token id beyond vocab", "POST", "/v1/completions", {"prompt": [1, 10**9]}, 400),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 400),
    ("unknown model (chat)", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 400),
    ("max_tokens negative", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("max_tokens zero", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens a string", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("max_tokens beyond context", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400),
    (
        "max_completion_tokens beyond context",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "max_completion_tokens": 5000},
        400,
    ),
    ("prompt over the context", "POST", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400),
    (
        "chat prompt over the context",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
    ),
    ("temperature -1", "POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("temperature a string", "POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("top_p 2", "POST", "/v1/completions", {"prompt": "hi", "top_p": 2}, 400),
    ("top_p 0", "POST", "/v1/chat/completions", {"messages": MSG, "top_p": 0}, 400),
    ("top_k -5", "POST", "/v1/completions", {"prompt": "hi", "top_k": -5}, 400),
    ("min_p 1.5", "POST", "/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400),
    ("presence_penalty 3", "POST", "/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400),
    ("frequency_penalty -3", "POST", "/v1/chat/completions", {"messages": MSG, "frequency_penalty": -3}, 400),
    ("repetition_penalty 0", "POST", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("n 0", "POST", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("n huge", "POST", "/v1/completions", {"prompt": "hi", "n": 100000}, 400),
    ("seed beyond 64 bits", "POST", "/v1/completions", {"prompt": "hi", "seed": 2**70}, 400),
    ("logprobs 50", "POST", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400),
    ("top_logprobs 99", "POST", "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400),
    ("stop is a number", "POST", "/v1/completions", {"prompt": "hi", "stop": 7}, 400),
    ("empty stop string", "POST", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("stream is a list", "POST", "/v1/completions", {"prompt": "hi", "stream": [1]}, 400),
    ("suffix", "POST", "/v1/completions", {"prompt": "hi", "suffix": "end"}, 400),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, 400),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, 400),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("missing role", "POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    ("content a number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}, 400),
    (
        "image content part",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
    ),
    ("message is a string", "POST", "/v1/chat/completions", {"messages": ["hi"]}, 400),
    ("detokenize bad ids", "POST", "/detokenize", {"tokens": [-1]}, 400),
    ("detokenize ids not a list", "POST", "/detokenize", {"tokens": "abc"}, 400),
    ("tokenize neither prompt nor messages", "POST", "/tokenize", {}, 400),
    ("message without content", "POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    (
        "assistant message without content",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
        400,
    ),
    (
        "response_format structural_tag",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "structural_tag"}},
        400,
    ),
    ("regex that does not parse", "POST", "/v1/completions", {"prompt": "hi", "regex": "(ab"}, 400),
    (
        "tool with a bad name",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "no spaces!", "parameters": {}}}]},
        400,
    ),
    ("logit_bias key not a token id", "POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"x": 10}}, 400),
    ("logit_bias out of range", "POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400),
    ("logit_bias past the vocabulary", "POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400),
    (
        "min_tokens above max_tokens",
        "POST",
        "/v1/completions",
        {"prompt": "hi", "min_tokens": 50, "max_tokens": 4},
        400,
    ),
    ("unknown field", "POST", "/v1/completions", {"prompt": "hi", "temprature": 0.5}, 400),
    ("unknown route", "GET", "/v1/nothing", None, 404),
    ("unknown route (post)", "POST", "/v2/completions", {"prompt": "hi"}, 404),
    ("wrong method", "GET", "/v1/completions", None, 405),
]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server()


def _send(base: str, method: str, path: str, body: Any) -> httpx.Response:
    kwargs: dict[str, Any] = {"timeout": 60}
    if isinstance(body, str):
        kwargs.update(content=body.encode(), headers={"content-type": "application/json"})
    elif body is not None:
        kwargs["json"] = body
    return httpx.request(method, base + path, **kwargs)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


def test_malformed_request_table(server: ServerProcess) -> None:
    assert len(CASES) >= 30
    failures = []
    for name, method, path, body, status in CASES:
        response = _send(server.base_url, method, path, body)
        try:
            assert_openai_error(response, status)
        except (AssertionError, json.JSONDecodeError) as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)
    # Nothing was queued, nothing leaked, and the server still answers a normal request.
    server.wait_idle()
    ok = _send(server.base_url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()


def test_openai_client_raises_bad_request(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert "temperature" in info.value.message


def test_api_key_guards_v1_routes(smol_engine: Engine) -> None:
    """In-process app over the shared eager engine (no second server process to start)."""
    app = build_app(smol_engine, api_key="s3cret")
    with TestClient(app) as http:
        assert_openai_error(http.get("/v1/models"), 401)
        assert_openai_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_openai_error(http.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
        assert_openai_error(http.post("/v1/completions", json={"prompt": "hi"}), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert http.get("/v1/models", headers=good).json()["data"][0]["id"] == MODEL
        response = http.post(
            "/v1/completions", headers=good, json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        assert http.get("/health").status_code == 200  # not a /v1 route
        assert_openai_error(http.get("/nope", headers=good), 404)


# (body extras, the field a 400 must name, or None: accepted)
FIELD_CASES: list[tuple[dict[str, Any], str | None]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),  # no schema
    ({"response_format": {"type": "text"}}, None),  # asks for nothing
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),  # no parser
    ({"tools": []}, None),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "none"}, None),
    ({"logit_bias": {"42": -100}}, None),
    ({"logit_bias": {"42": "much"}}, "logit_bias"),
    ({"min_tokens": 2}, None),
    ({"min_tokens": -1}, "min_tokens"),
    ({"allowed_token_ids": [5, 9]}, None),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["no"]}, "bad_words"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"guided_json": {"type": "object"}}, None),
    ({"guided_regex": "[a-z]+"}, None),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, None),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "regex": "a+"}, "regex"),  # two constraints
    ({"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"ebnf": 'root ::= "yes" | "no"'}, None),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"best_of": 3}, "best_of"),
    ({"user": "someone", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}, None),  # harmless metadata
    ({"frequency_penaltyy": 0.2}, "frequency_penaltyy"),  # a typo is an unknown field, not a silent default
]


@pytest.mark.parametrize("extra,refused", FIELD_CASES)
def test_every_field_is_honoured_or_refused_by_name(
    smol_engine: Engine, extra: dict[str, Any], refused: str | None
) -> None:
    app = build_app(smol_engine)
    body = {"messages": MSG, "max_tokens": 2, "ignore_eos": True, **extra}
    with TestClient(app) as http:
        response = http.post("/v1/chat/completions", json=body)
        if refused is None:
            assert response.status_code == 200, response.text
        else:
            error = assert_openai_error(response, 400)
            assert error["param"] == refused and refused in error["message"], error
    assert smol_engine.kv_pages_in_use() == 0


def test_allow_unknown_fields_ignores_extras_but_still_refuses_features(smol_engine: Engine) -> None:
    from engine.server.app import ServerSettings

    app = build_app(smol_engine, settings=ServerSettings(allow_unknown_fields=True))
    with TestClient(app) as http:
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "my_extra": 1})
        assert ok.status_code == 200, ok.text
        error = assert_openai_error(http.post("/v1/completions", json={"prompt": "Hi", "best_of": 3}), 400)
        assert error["param"] == "best_of"


def test_a_failing_step_fails_its_requests_and_the_engine_lives_on(smol_engine: Engine) -> None:
    """Fault injection (the real engine; one step made to raise): the request gets an error, not a hang."""
    app = build_app(smol_engine)
    runner = smol_engine.runner
    original = runner.launch
    calls = {"n": 0}

    def fail_once(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return original(*args)

    runner.launch = fail_once  # type: ignore[method-assign]
    try:
        with TestClient(app) as http:
            failed = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
            assert_openai_error(failed, 500)
            assert "injected step failure" in failed.json()["error"]["message"]
            ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            assert http.get("/health").status_code == 200
    finally:
        del runner.launch  # back to the class's method
    assert smol_engine.kv_pages_in_use() == 0
