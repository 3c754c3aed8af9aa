"""Tool calling through /v1/chat/completions on the real engine (SmolLM2, CPU, in-process app).

"required" and named functions are forced by a grammar, so the calls must parse whatever the small
model would have said; "auto" reads Hermes <tool_call> blocks, held here to texts written for it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_server_errors import assert_openai_error

from engine.engine import Engine
from engine.server.app import ServerSettings, build_app
from engine.server.tools import ToolPlan, calls_from_text, plan_tools, streamable_prefix

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture()
def http(smol_engine: Engine):
    with TestClient(build_app(smol_engine, settings=ServerSettings(tool_call_parser="hermes"))) as client:
        yield client
    assert smol_engine.kv_pages_in_use() == 0


def _chat(http: TestClient, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 96, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _weather_arguments(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"} and value["unit"] in ("C", "F") and len(value["city"]) <= 16


def test_a_named_function_is_always_called_with_arguments_of_its_schema(http: TestClient) -> None:
    body = _chat(
        http,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        n=2,
        temperature=1.0,
        seed=5,
    )
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert (
            call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        )
        _weather_arguments(call["function"]["arguments"])


def test_required_makes_one_call_of_some_tool_and_streams_it_whole(http: TestClient) -> None:
    request = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    full = _chat(http, **request)["choices"][0]
    assert full["finish_reason"] == "tool_calls"
    [call] = full["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time")
    json.loads(call["function"]["arguments"])
    stream = http.post(
        "/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 96, "stream": True, **request}
    )
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("content") for d in deltas)  # the call is not leaked as content
    [streamed] = [call for d in deltas for call in d["delta"].get("tool_calls") or []]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_none_leaves_the_tools_out_and_auto_shows_them(http: TestClient) -> None:
    plain = _chat(http, max_tokens=4)["usage"]["prompt_tokens"]
    none = _chat(http, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert none["usage"]["prompt_tokens"] == plain and none["choices"][0]["message"]["tool_calls"] is None
    auto = _chat(http, tools=TOOLS, max_tokens=4)  # SmolLM2's template takes no tools: a Hermes preamble
    assert auto["usage"]["prompt_tokens"] > plain + 60


def test_a_history_of_calls_and_results_is_rendered_not_refused(http: TestClient, smol_engine: Engine) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    body = _chat(http, messages=history, tools=TOOLS, max_tokens=8)
    prompt = smol_engine.tokenizer.decode(http.post("/tokenize", json={"messages": history}).json()["tokens"])
    assert "<tool_call>" in prompt and '"get_weather"' in prompt and "<tool_response>\n18 C and sunny" in prompt
    assert body["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            },
            "messages[1].tool_calls",
        ),
    ],
)
def test_tool_requests_it_cannot_honour_are_a_400_naming_the_field(http: TestClient, body: dict, param: str) -> None:
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert assert_openai_error(response, 400)["param"] == param


def test_auto_without_a_parser_is_refused(smol_engine: Engine) -> None:
    with TestClient(build_app(smol_engine)) as client:
        error = assert_openai_error(client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}), 400)
    assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    with TestClient(build_app(smol_engine)) as client:  # a tool message needs the call it answers
        response = client.post("/v1/chat/completions", json={"messages": [*ASK, {"role": "tool", "content": "x"}]})
        assert_openai_error(response, 400)


def test_hermes_blocks_become_calls_and_the_rest_stays_content() -> None:
    plan = plan_tools(TOOLS, "auto", None, "hermes")
    assert isinstance(plan, ToolPlan)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
        "</tool_call>\n"
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    )
    content, calls = calls_from_text(plan, text)
    assert content == "Let me check.\n\n" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "C"}
    assert calls_from_text(plan, "<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert (
        calls_from_text(plan_tools(TOOLS, "auto", False, "hermes"), text)[1][0].name == "get_weather"
    )  # one call only
    # While streaming, content stops where a call may begin, even a call's first characters.
    assert streamable_prefix(plan, "Let me check.\n<tool_") == len("Let me check.\n")
    assert streamable_prefix(plan, "Let me check.\n<tool_call>{") == len("Let me check.\n")
    assert streamable_prefix(plan, "No tools needed.") == len("No tools needed.")
