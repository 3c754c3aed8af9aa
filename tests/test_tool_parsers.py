"""Every tool-call format over a table of texts: well-formed, truncated, malformed, several calls,
text around them. For each text, the expected non-streaming answer where it is written out, and the
stream (the chat handler's own delta function) cut into chunks of every size from one character to
the whole text, which must give exactly the non-streaming answer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.serving import Choice, _tool_delta
from engine.server.tool_parsers import PARSERS
from engine.server.tools import ToolPlan, calls_from_text

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
W = {"city": "Paris", "unit": "C"}
T = {"zone": "CET", "note": "caf\u00e9 \U0001f600"}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def hermes(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{_json({'name': name, 'arguments': arguments})}\n</tool_call>"


def glm(name: str, arguments: dict[str, Any]) -> str:
    pairs = "".join(
        f"\n<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _json(v)}</arg_value>"
        for k, v in arguments.items()
    )
    return f"<tool_call>{name}{pairs}\n</tool_call>"


def llama(name: str, arguments: Any) -> str:
    return _json({"name": name, "parameters": arguments})


def mistral_list(*calls: tuple[str, Any]) -> str:
    return "[TOOL_CALLS]" + _json([{"name": n, "arguments": a} for n, a in calls])


def mistral_args(name: str, arguments: Any) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{_json(arguments)}"


# (text, expected (content, [(name, arguments)])) or (text, None) where only agreement is asserted.
Case = tuple[str, tuple[str | None, list[tuple[str, Any]]] | None]


def _with_truncations(text: str, cuts: int = 6) -> list[Case]:
    """A complete text and its prefixes cut at spread points (a call cut off by max_tokens)."""
    step = max(1, len(text) // (cuts + 1))
    return [(text[:end], None) for end in range(step, len(text), step)][:cuts]


def hermes_cases() -> list[Case]:
    one, two = hermes("get_weather", W), hermes("get_time", T)
    cases: list[Case] = [
        (one, (None, [("get_weather", W)])),
        (one + "\n" + two, ("\n", [("get_weather", W), ("get_time", T)])),
        ("Let me check.\n" + one, ("Let me check.\n", [("get_weather", W)])),
        ("Before. " + one + " After.", ("Before.  After.", [("get_weather", W)])),
        ("No tools needed here.", ("No tools needed here.", [])),
        ("<tool_call>{not json}</tool_call>", ("<tool_call>{not json}</tool_call>", [])),
        ("<tool_call>" + _json({"arguments": W}) + "</tool_call>", None),  # no name
        ("<tool_call>" + _json({"name": "f", "arguments": [1]}) + "</tool_call>", None),  # arguments not an object
        ('<tool_call>{"name": "f"}</tool_call>', (None, [("f", {})])),
        ("<tool_call>" + _json({"name": "f", "parameters": {"a": 1}}) + "</tool_call>", (None, [("f", {"a": 1})])),
        ("a <tool_call> b", ("a <tool_call> b", [])),
        ("<tool_", ("<tool_", [])),
        ("text <tool_call", ("text <tool_call", [])),
        (two + two, (None, [("get_time", T), ("get_time", T)])),
        ("<tool_call>{not json}</tool_call>" + one, ("<tool_call>{not json}</tool_call>", [("get_weather", W)])),
        ("", ("", [])),
    ]
    cases += _with_truncations(one) + _with_truncations("Intro. " + one + "\n" + two) + _with_truncations(two + " tail")
    return cases


def glm_cases() -> list[Case]:
    one, two = glm("get_weather", W), glm("get_time", T)
    nested = glm("search", {"query": "x", "filters": {"year": 2024}, "limit": 5})
    cases: list[Case] = [
        (one, (None, [("get_weather", W)])),
        (one + "\n" + two, ("\n", [("get_weather", W), ("get_time", T)])),
        ("Checking.\n" + one, ("Checking.\n", [("get_weather", W)])),
        (nested, (None, [("search", {"query": "x", "filters": {"year": 2024}, "limit": 5})])),
        ("<tool_call>ping\n</tool_call>", (None, [("ping", {})])),
        ("<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", ("<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", [])),
        ("<tool_call>f\n<arg_key>a</arg_key><arg_key>b</arg_key><arg_value>1</arg_value></tool_call>", None),
        ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>a</arg_key>\n</tool_call>", None),
        ("<tool_call>\n</tool_call>", ("<tool_call>\n</tool_call>", [])),
        ("<tool_call>f\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", None),
        ("Plain answer.", ("Plain answer.", [])),
        ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>", ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>", [])),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>", ("<tool_call>get_weather\n<arg_key>city</arg_key>", [])),
        ("x" + one + "y" + two + "z", ("xyz", [("get_weather", W), ("get_time", T)])),
        ("", ("", [])),
    ]
    cases += _with_truncations(one) + _with_truncations(one + two) + _with_truncations("Sure. " + nested)
    return cases


def llama_cases() -> list[Case]:
    one, two = llama("get_weather", W), llama("get_time", T)
    cases: list[Case] = [
        (one, (None, [("get_weather", W)])),
        (one + "; " + two, (None, [("get_weather", W), ("get_time", T)])),
        (one + ";" + two, (None, [("get_weather", W), ("get_time", T)])),
        ("<|python_tag|>" + one, (None, [("get_weather", W)])),
        ("  " + one + "  ", (None, [("get_weather", W)])),
        ("The weather is nice.", ("The weather is nice.", [])),
        ("{not json", ("{not json", [])),
        (one + " and some text", (one + " and some text", [])),
        (_json({"name": "f"}), (None, [("f", {})])),
        (_json({"name": "f", "arguments": {"a": 1}}), (None, [("f", {"a": 1})])),
        (_json({"parameters": W}), None),
        (_json([1, 2]), ("[1, 2]", [])),
        (one + ";", None),
        (one + "; {bad", None),
        ("<|python", ("<|python", [])),
        ("", ("", [])),
        ("Sure: " + one, ("Sure: " + one, [])),  # not at the start: not this format
    ]
    cases += _with_truncations(one) + _with_truncations(one + "; " + two) + _with_truncations("<|python_tag|>" + two)
    return cases


def mistral_cases() -> list[Case]:
    listed = mistral_list(("get_weather", W), ("get_time", T))
    one, two = mistral_args("get_weather", W), mistral_args("get_time", T)
    cases: list[Case] = [
        (listed, (None, [("get_weather", W), ("get_time", T)])),
        (mistral_list(("get_weather", W)), (None, [("get_weather", W)])),
        ("Let me see. " + listed, ("Let me see. ", [("get_weather", W), ("get_time", T)])),
        (one, (None, [("get_weather", W)])),
        (one + two, (None, [("get_weather", W), ("get_time", T)])),
        ("Checking. " + one, ("Checking. ", [("get_weather", W)])),
        ("[TOOL_CALLS][]", ("[TOOL_CALLS][]", [])),
        ("[TOOL_CALLS][{bad", ("[TOOL_CALLS][{bad", [])),
        ("[TOOL_CALLS]get_weather[ARGS]{bad", ("[TOOL_CALLS]get_weather[ARGS]{bad", [])),
        ("[TOOL_CALLS]" + _json([{"arguments": W}]), None),
        ("[TOOL_CALLS]f[ARGS][1]", ("[TOOL_CALLS]f[ARGS][1]", [])),
        ("No call at all.", ("No call at all.", [])),
        ("[TOOL_", ("[TOOL_", [])),
        ("[TOOL_CALLS]", ("[TOOL_CALLS]", [])),
        (one + " trailing words", (" trailing words", [("get_weather", W)])),
        ("", ("", [])),
    ]
    cases += _with_truncations(listed) + _with_truncations(one + two) + _with_truncations("Hmm. " + one)
    return cases


TABLES = {"hermes": hermes_cases(), "glm45": glm_cases(), "llama3_json": llama_cases(), "mistral": mistral_cases()}


def _stream(plan: ToolPlan, text: str, size: int) -> tuple[str, list[tuple[str, str]], bool]:
    choice = Choice(0, None, [1], SamplingParams(), tool_plan=plan)
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    content, calls = "", []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        output = RequestOutput("r", None, [1], [], "", last, "stop" if last else None, new_text=piece)
        delta, tool_calls, reason = _tool_delta(choice, piece, output)
        content += delta or ""
        calls += [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls or []]
    return content, calls, reason == "tool_calls"


@pytest.mark.parametrize("parser", list(TABLES))
def test_each_table_has_at_least_30_texts(parser: str) -> None:
    assert len(TABLES[parser]) >= 30


@pytest.mark.parametrize("parser", list(TABLES))
def test_streaming_in_chunks_of_every_size_gives_the_non_streaming_answer(parser: str) -> None:
    plan = ToolPlan(TOOLS, "auto", parser=parser)
    for text, expected in TABLES[parser]:
        content, calls = calls_from_text(plan, text)
        if expected is not None:
            want_content, want_calls = expected
            assert content == (want_content if want_calls else text), (parser, text)
            assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls, (parser, text)
        whole = ((content or "") if calls else text, [(c.name, c.arguments) for c in calls])
        for size in range(1, len(text) + 2):
            streamed_content, streamed_calls, said_tool_calls = _stream(plan, text, size)
            assert (streamed_content, streamed_calls) == whole, (parser, text, size)
            assert said_tool_calls == bool(calls)


def test_only_complete_calls_are_calls() -> None:
    """A truncated text never yields a call that the whole text does not hold."""
    for parser, table in TABLES.items():
        for text, _ in table:
            for end in range(len(text)):
                _, calls = PARSERS[parser].parse(text[:end])
                for call in calls:
                    json.loads(call.arguments)  # every call's arguments are complete JSON


def test_self_contained_calls_go_out_as_soon_as_they_are_complete() -> None:
    plan = ToolPlan(TOOLS, "auto", parser="hermes")
    text = hermes("get_weather", W) + " and then some closing words that keep coming"
    choice = Choice(0, None, [1], SamplingParams(), tool_plan=plan)
    first_call_at = None
    for index in range(len(text)):
        output = RequestOutput("r", None, [1], [], "", False, None, new_text=text[index])
        _, tool_calls, _ = _tool_delta(choice, text[index], output)
        if tool_calls and first_call_at is None:
            first_call_at = index
    assert first_call_at == len(hermes("get_weather", W)) - 1  # the chunk that closed the block, not the last
