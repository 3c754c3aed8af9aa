"""Tool calling for /v1/chat/completions: tools into the prompt, tool calls out of the text.

- `tool_choice: "required"` or a named function: the call is *forced by a grammar* (structured
  output), so it works with any model: "required" constrains the text to a JSON array of
  {"name", "parameters"} objects, one schema per tool; a named function to that function's
  parameter schema. The JSON becomes `message.tool_calls` (vLLM's approach for both).
- `tool_choice: "auto"` (the default when tools are given): the model decides, and its text is read
  by the parser the operator names (`engine serve --tool-call-parser hermes|llama3_json|mistral|glm45`,
  engine/server/tool_parsers.py). Without a parser "auto" is a 400, as in vLLM, rather than tools the
  model could not use.
- `tool_choice: "none"`: the tools are left out of the prompt and no call is parsed.

Tools reach the model through the chat template's own `tools` argument where the template renders
them; a template that does not (SmolLM2's) gets them as a system-message preamble in the Hermes
format, so they are never silently dropped. Assistant `tool_calls` and `tool` results in the history
are passed the same way: as the template's fields where it reads them, else as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.server.errors import APIError
from engine.server.tool_parsers import PARSERS, ToolCall
from engine.structured.spec import GrammarSpec

TOOL_CALL_PARSERS = tuple(PARSERS)
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class ToolPlan:
    """What a chat request's tools and tool_choice ask for."""

    tools: list[dict[str, Any]]  # the request's tools, validated ({"type": "function", "function": {...}})
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True
    grammar: GrammarSpec | None = None  # the grammar that forces the call ("required", "function")
    parser: str | None = None  # "auto": how the text is read

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown (none for tool_choice "none")."""
        return self.tools if self.tools and self.choice != "none" else None

    @property
    def parses_calls(self) -> bool:
        return self.choice in ("required", "function") or (self.choice == "auto" and self.parser is not None)


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, parser: str | None) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools; APIError (400) naming the field otherwise."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    checked = _check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(checked, "none", parallel=parallel)
    if choice == "auto":
        if parser is None:
            raise APIError(
                'tool_choice "auto" needs the server started with --tool-call-parser (one of '
                f'{", ".join(TOOL_CALL_PARSERS)}); "required" or a named function work with any model',
                param="tool_choice",
            )
        return ToolPlan(checked, "auto", parallel=parallel, parser=parser)
    if choice == "required":
        return ToolPlan(checked, "required", parallel=parallel, grammar=_required_grammar(checked, parallel))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError(
                f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", param="tool_choice"
            )
        tool = checked[names.index(name)]["function"]
        return ToolPlan(
            checked, "function", function=name, parallel=parallel, grammar=GrammarSpec.json_schema(_parameters(tool))
        )
    raise APIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError("tools must be a list", param="tools")
    seen = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        function = tool["function"]
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise APIError(f"{where}.function: unknown field {unknown[0]!r}", param=where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", param=where)
        if name in seen:
            raise APIError(f"{where}: a second tool named {name!r}", param=where)
        seen.add(name)
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise APIError(f"{where}.function.parameters must be a JSON schema object", param=where)
        if not isinstance(function.get("description", ""), str):
            raise APIError(f"{where}.function.description must be a string", param=where)
    return tools


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _required_grammar(tools: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t["function"])},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    try:
        return GrammarSpec.json_schema(schema)
    except InvalidRequestError as exc:
        raise APIError(f"tools: {exc}", param="tools") from exc


# ---- the prompt ---------------------------------------------------------------------------------


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def hermes_preamble(tools: list[dict[str, Any]]) -> str:
    """The tools as a system message in the Hermes / Qwen format, for templates that take no `tools`."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def history_message(
    role: str, content: str, tool_calls: list[dict[str, Any]] | None, tool_call_id: str | None, native: bool
) -> dict[str, Any]:
    """One conversation entry for the template. native: the template reads `tool_calls` itself (then the
    arguments go as objects, as HF templates expect); otherwise the calls become Hermes text."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        calls = [_history_call(call) for call in tool_calls]
        if native:
            message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
        else:
            text = "\n".join(
                f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                for n, a in calls
            )
            message["content"] = f"{content}\n{text}" if content else text
    if tool_call_id is not None:
        if native:
            message["tool_call_id"] = tool_call_id
        else:
            message["content"] = f"<tool_response>\n{content}\n</tool_response>"
    return message


def _history_call(call: Any) -> tuple[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidRequestError(
            'each tool call must be {"id": ..., "type": "function", "function": {"name", "arguments"}}'
        )
    function = call["function"]
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a tool call needs a function name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"tool call {name!r}: arguments are not JSON ({exc})") from exc
    return name, arguments


# ---- the output ---------------------------------------------------------------------------------


def calls_from_text(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output. Text that does not parse stays content."""
    if plan.choice == "function":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut off by max_tokens: not a call
        return None, [ToolCall(plan.function or "", text)]
    if plan.choice == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    if plan.choice == "auto" and plan.parser is not None:
        content, calls = PARSERS[plan.parser].parse(text)
        return content, calls if plan.parallel else calls[:1]
    return text, []


def streams_calls_early(plan: ToolPlan) -> bool:
    """Whether a complete call can go out before the output ends (its format's calls are self-contained)."""
    return plan.choice == "auto" and plan.parser is not None and PARSERS[plan.parser].incremental


def streamable_prefix(plan: ToolPlan, text: str) -> int:
    """How much of the text so far can go out as content while the output streams: none when the call
    is forced (the whole text is the call), up to the first possible `<tool_call>` in auto mode."""
    if plan.choice in ("required", "function"):
        return 0
    if plan.choice != "auto" or plan.parser is None:
        return len(text)
    return PARSERS[plan.parser].content_end(text)
