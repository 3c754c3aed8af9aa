"""Tool-call parsers for tool_choice "auto": the formats models write their calls in.

Each parser answers two questions about a text: what of it is content and which calls it holds
(`parse`, on the finished text), and how much of a text still being streamed is surely content
(`content_end`: the stream holds back from the first place a call may start). The stream sends
content up to `content_end`; each call as soon as it is complete where calls are self-contained
blocks (`incremental`: hermes, glm45), else once the output ends; then whatever content follows. So a
stream cut into chunks of any size gives exactly the non-streamed answer (tests/test_tool_parsers.py holds
every format to that over its table of texts).

Only a complete call is a call: a call cut off by max_tokens, or one that does not parse (broken
JSON, a GLM key without its value), stays in the content as the model wrote it.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes, SmolLM3).
- `llama3_json`: the whole output one or more `{"name": ..., "parameters": {...}}` objects separated
  by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2/3.3).
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers) or
  `name[ARGS]{...}` per call (v11+).
- `glm45`: `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>` (GLM-4.5/4.6);
  a value that is JSON is taken as JSON, anything else as a string.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            body["index"] = index
        return body


def _json_arguments(value: Any) -> str | None:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_of(value: Any, *argument_keys: str) -> ToolCall | None:
    """{"name": str, <argument key>: {...}} -> a call, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    text = _json_arguments(arguments)
    return ToolCall(value["name"], text) if text is not None else None


def _marker_end(text: str, marker: str) -> int:
    """content_end for a marker that may appear anywhere: its first occurrence, or before a partial
    marker at the very end."""
    start = text.find(marker)
    if start != -1:
        return start
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def _join_content(*parts: str) -> str | None:
    """The text around the calls, as written (not stripped: the stream sent it as it came)."""
    return "".join(parts) or None


# ---- the formats -------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _tagged_calls(
    text: str, block: re.Pattern[str], call_of: Callable[[str], ToolCall | None]
) -> tuple[str | None, list[ToolCall]]:
    """Calls from the blocks `block` matches (its group 1 read by `call_of`); blocks that are not calls
    and the text around the calls are the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    cursor = 0
    for match in block.finditer(text):
        call = call_of(match.group(1))
        if call is None:
            continue  # not a call: stays in the content
        kept.append(text[cursor : match.start()])
        cursor = match.end()
        calls.append(call)
    if not calls:
        return text, []
    return _join_content(*kept, text[cursor:]), calls


def _hermes_call(body: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(body), "arguments", "parameters")
    except json.JSONDecodeError:
        return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    return _tagged_calls(text, _HERMES, _hermes_call)


_GLM_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_call(body: str) -> ToolCall | None:
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name or "\n" in name:
        return None
    rest = "<arg_key>" + rest if rest else ""
    arguments: dict[str, Any] = {}
    position = 0
    while position < len(rest.rstrip()):
        pair = _GLM_PAIR.match(rest, position)
        if pair is None:
            return None  # a key without its value, or stray text between pairs
        key, value = pair.group(1).strip(), pair.group(2)
        try:
            arguments[key] = json.loads(value)
        except json.JSONDecodeError:
            arguments[key] = value
        position = pair.end()
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def parse_glm45(text: str) -> tuple[str | None, list[ToolCall]]:
    return _tagged_calls(text, _GLM_BLOCK, _glm_call)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while True:
        try:
            value, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(value, "parameters", "arguments")
        if call is None:
            return text, []
        calls.append(call)
        rest = body[position:].lstrip()
        if not rest:
            return None, calls
        if not rest.startswith(";"):
            return text, []  # text after the calls: not this format
        position = len(body) - len(rest) + 1
        while position < len(body) and body[position].isspace():
            position += 1


def llama3_content_end(text: str) -> int:
    """The format is the whole output: one that starts (or may start) with a call is held back."""
    stripped = text.lstrip()
    if not stripped:
        return 0
    if stripped.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(stripped):
        return 0
    return len(text)


_MISTRAL = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_MISTRAL)
    if start == -1:
        return text, []
    before, body = text[:start], text[start + len(_MISTRAL) :]
    calls: list[ToolCall] = []
    if body.lstrip().startswith("["):
        try:
            items, end = json.JSONDecoder().raw_decode(body.lstrip())
        except json.JSONDecodeError:
            return text, []
        if not isinstance(items, list) or not items:
            return text, []
        for item in items:
            call = _call_of(item, "arguments", "parameters")
            if call is None:
                return text, []
            calls.append(call)
        return _join_content(before, body.lstrip()[end:]), calls
    decoder = json.JSONDecoder()
    rest = body
    while True:  # name[ARGS]{...}, repeated, each after its own [TOOL_CALLS] or straight after the last
        name, separator, tail = rest.partition(_MISTRAL_ARGS)
        if not separator or not name.strip() or any(c in name for c in "{}[]\n"):
            return text, []
        try:
            arguments, end = decoder.raw_decode(tail)
        except json.JSONDecodeError:
            return text, []
        if _json_arguments(arguments) is None:
            return text, []
        calls.append(ToolCall(name.strip(), _json_arguments(arguments) or "{}"))
        rest = tail[end:]
        if rest.startswith(_MISTRAL):
            rest = rest[len(_MISTRAL) :]
        elif not rest.strip():
            return _join_content(before), calls
        else:
            return _join_content(before, rest), calls


@dataclass(frozen=True)
class ToolCallParser:
    name: str
    parse: Callable[[str], tuple[str | None, list[ToolCall]]]
    content_end: Callable[[str], int]
    # Each call a block of its own, decided by its own text: a complete one found in a prefix of the
    # output is a call of the whole output, so the stream can send it at once. Not so for llama3_json
    # (text after the calls makes them content) or mistral (one list, or a chain after one marker).
    incremental: bool = False


PARSERS: dict[str, ToolCallParser] = {
    "hermes": ToolCallParser("hermes", parse_hermes, lambda text: _marker_end(text, "<tool_call>"), incremental=True),
    "llama3_json": ToolCallParser("llama3_json", parse_llama3_json, llama3_content_end),
    "mistral": ToolCallParser("mistral", parse_mistral, lambda text: _marker_end(text, _MISTRAL)),
    "glm45": ToolCallParser("glm45", parse_glm45, lambda text: _marker_end(text, "<tool_call>"), incremental=True),
}
