"""Issue #48's smaller findings (its point 7), in this process through TestClient.

A list of too many stop strings named `"param": "at"`; a `$ref` to `http://...` or `file:///...` was taken for
"any JSON" (a constraint silently dropped); large bodies were parsed on the event loop. (The slow body's 408 and
HTTP/1.0 health checks are in test_server_connections.py, SIGTERM during a check in test_server_shutdown.py,
/metrics' pending requests in test_server_fairness.py.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_server_errors import assert_openai_error

from engine.engine import Engine
from engine.server.app import build_app
from engine.server.bodies import INLINE_BYTES


@pytest.fixture(scope="module")
def http(smol_engine: Engine) -> Any:
    with TestClient(build_app(smol_engine)) as client:
        yield client


@pytest.mark.parametrize(
    "field,value",
    [("stop", ["x"] * 100), ("stop", ["y" * 5000]), ("stop", [""]), ("stop_token_ids", list(range(2000)))],
)
def test_sampling_errors_name_their_field(http: Any, field: str, value: Any) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", field: value}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], field: value}),
    ):
        error = assert_openai_error(http.post(path, json=body), 400)
        assert error["param"] == field, error


def _schema(ref: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"$ref": ref}}}


@pytest.mark.parametrize("ref", ["http://example.com/schema.json", "file:///etc/passwd", "other.json#/a"])
def test_a_ref_outside_the_schema_is_refused(http: Any, ref: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(ref)}}
    error = assert_openai_error(
        http.post("/v1/completions", json={"prompt": "hi", "response_format": response_format}), 400
    )
    assert error["param"] == "response_format", error
    assert f"$ref {ref!r} points outside the schema" in error["message"], error
    tool = {"type": "function", "function": {"name": "f", "parameters": _schema(ref)}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required"}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "tools" and "points outside the schema" in error["message"], error


def test_a_description_that_mentions_a_ref_is_no_ref(http: Any) -> None:
    """Only a "$ref" key counts: a string that quotes one is text (refused only by the compiler's verdict)."""
    from engine.server.structured_fields import check_schema_refs
    from engine.structured.spec import GrammarSpec

    check_schema_refs(GrammarSpec.json_schema({"type": "string", "description": 'see "$ref": "http://x"'}))
    check_schema_refs(GrammarSpec.json_schema({"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"}))


@pytest.mark.parametrize("size", [100, INLINE_BYTES + 1000])
def test_bodies_parsed_off_the_loop_answer_as_fastapi_did(http: Any, size: int) -> None:
    """Small and large bodies (the large on the parser's thread) give the same answers: a 200, a 400 naming the
    field, invalid JSON, a body nested too deep."""
    padding = " " * size
    ok = http.post("/v1/completions", content=f'{{"prompt": "Hi", "max_tokens": 1}}{padding}'.encode())
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    error = assert_openai_error(http.post("/v1/completions", content=f'{{"prompt": 5}}{padding}'.encode()), 400)
    assert error["param"] == "prompt", error
    error = assert_openai_error(http.post("/v1/completions", content=f'{{"prompt": }}{padding}'.encode()), 400)
    assert error["message"].startswith("request body is not valid JSON"), error
    deep = "[" * 100_000 + "]" * 100_000
    error = assert_openai_error(http.post("/v1/completions", content=deep.encode()), 400)
    assert "nests too deep" in error["message"], error
    error = assert_openai_error(
        http.post("/detokenize", content=json.dumps({"tokens": ["x"]}).encode() + padding.encode()), 400
    )
    assert error["param"] == "tokens", error
