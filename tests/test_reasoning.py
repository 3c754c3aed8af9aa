"""reasoning_content: the split of <think> text, and its stream, chunk by chunk, against the whole text.

The embedded SmolLM2 never thinks, so the chat handler's stream is driven here with the outputs an
engine would send for a thinking model's text (the same RequestOutput deltas), through the real
Serving code: the reasoning split, then the tool-call parser on what is left.
"""

from __future__ import annotations

import json

import pytest

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.params import ModelInfo
from engine.server.protocol import ChatCompletionRequest
from engine.server.reasoning import ReasoningStream, split_reasoning
from engine.server.serving import Choice, Serving, _assistant_message
from engine.server.tools import plan_tools

# (text, deepseek_r1 split, qwen3 split)
CASES = [
    (
        "<think>\nPlan it.\n</think>\n\nThe answer.",
        ("\nPlan it.\n", "\n\nThe answer."),
        ("\nPlan it.\n", "\n\nThe answer."),
    ),
    ("Plan it.</think>The answer.", ("Plan it.", "The answer."), ("", "Plan it.</think>The answer.")),
    ("The answer, no thought.", ("The answer, no thought.", ""), ("", "The answer, no thought.")),
    ("<think>cut off while thinking", ("cut off while thinking", ""), ("cut off while thinking", "")),
    ("<think></think>empty thought", ("", "empty thought"), ("", "empty thought")),
    ("  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("a</think>b</think>c", ("a", "b</think>c"), ("", "a</think>b</think>c")),
    ("<think>x</thin", ("x</thin", ""), ("x</thin", "")),
    ("<thi", ("<thi", ""), ("", "<thi")),
    ("", ("", ""), ("", "")),
    (
        "<think>\u00e9t\u00e9 \U0001f600</think>\u00e7a",
        ("\u00e9t\u00e9 \U0001f600", "\u00e7a"),
        ("\u00e9t\u00e9 \U0001f600", "\u00e7a"),
    ),
]


@pytest.mark.parametrize("text,deepseek,qwen3", CASES)
def test_the_split_and_every_chunking_of_its_stream_agree(text: str, deepseek: tuple, qwen3: tuple) -> None:
    for parser, want in (("deepseek_r1", deepseek), ("qwen3", qwen3)):
        assert split_reasoning(parser, text) == want
        for size in range(1, len(text) + 2):
            stream = ReasoningStream(parser)
            chunks = [text[i : i + size] for i in range(0, len(text), size)] or [""]
            got = ["", ""]
            for index, chunk in enumerate(chunks):
                reasoning, content = stream.feed(chunk, index == len(chunks) - 1)
                got[0] += reasoning
                got[1] += content
            assert tuple(got) == want, (parser, size)


def _outputs(text: str, size: int) -> list[RequestOutput]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        RequestOutput(
            "r",
            None,
            [1],
            [],
            text[: sum(map(len, pieces[: i + 1]))],
            i == len(pieces) - 1,
            "stop" if i == len(pieces) - 1 else None,
            new_text=piece,
        )
        for i, piece in enumerate(pieces)
    ]


def test_the_chat_stream_splits_reasoning_then_reads_tool_calls() -> None:
    serving = Serving(None, ModelInfo("m", 4096, 100, None), reasoning_parser="qwen3", tool_call_parser="hermes")  # type: ignore[arg-type]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, "hermes")
    text = (
        '<think>I should look it up.</think>Checking.<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>'
    )
    whole = _assistant_message(plan, "qwen3", text)
    assert whole.reasoning_content == "I should look it up." and whole.content == "Checking."
    assert whole.tool_calls and whole.tool_calls[0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    for size in (1, 3, 7, len(text)):
        choice = Choice(0, None, [1], SamplingParams(), tool_plan=plan, reasoning_parser="qwen3")
        chunks = [serving._chat_chunk(request, "id", 0, choice, output) for output in _outputs(text, size)]
        deltas = [c["choices"][0] for c in chunks if c is not None]
        assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "I should look it up."
        assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
        calls = [call for d in deltas for call in d["delta"].get("tool_calls") or []]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("lookup", {"q": "x"})
        ]
        assert deltas[-1]["finish_reason"] == "tool_calls"
    serving.close()
