"""SIGTERM while a request streams: the stream is finished, then the process exits with status 0.

Runs last among the server tests (file order) and stops the shared server process.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from server_helpers import MODEL, start_server, take_shared_server


def test_sigterm_finishes_running_streams_and_exits_cleanly() -> None:
    server = take_shared_server()
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.log()[-3000:]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # The running request was allowed to finish (graceful shutdown), not cut off.
    assert chunks[-1]["usage"]["completion_tokens"] == 48
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    log = server.log()
    assert "engine thread stopped" in log and "Traceback" not in log
    # The port is closed: new requests are refused.
    try:
        httpx.get(f"{server.base_url}/health", timeout=2)
        raise AssertionError("server still answering after shutdown")
    except httpx.ConnectError:
        pass


def test_requests_still_running_at_the_shutdown_deadline_end_cleanly() -> None:
    """--shutdown-timeout 3 with longer requests: each stream ends with an error event and [DONE], each
    non-streaming request gets a JSON 503, and the process exits on time with status 0. So does a request whose
    grammar is still being checked (issue #48: uvicorn cancelled it at the deadline, a plain-text 500)."""
    server = start_server("--shutdown-timeout", "3", log_name="server-deadline")
    try:
        long_body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 1800, "ignore_eos": True}
        results: dict[str, object] = {}

        def non_streaming() -> None:
            results["plain"] = httpx.post(f"{server.base_url}/v1/completions", json=long_body, timeout=60)

        # 2,000 properties: within the limits, ~28 s of CPU to compile; still in its check at the deadline.
        fields = {f"slow_{i}": {"type": ["string", "integer", "null"]} for i in range(2000)}
        slow_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": fields}}}

        def checking() -> None:
            body = {"prompt": "hi", "max_tokens": 3, "response_format": slow_schema}
            results["grammar"] = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)

        plain = threading.Thread(target=non_streaming)
        plain.start()
        grammar = threading.Thread(target=checking)
        grammar.start()
        events = []
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json={**long_body, "stream": True}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    signalled = time.monotonic()
                    server.process.send_signal(signal.SIGTERM)
        plain.join(30)
        grammar.join(30)
        assert server.process.wait(30) == 0, server.log()[-3000:]
        assert time.monotonic() - signalled < 10
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == 503 and "shutting down" in error["error"]["message"]
        for name in ("plain", "grammar"):
            response = results[name]
            assert response.status_code == 503, (name, response.text)  # type: ignore[attr-defined]
            assert response.json()["error"]["code"] == 503  # type: ignore[attr-defined]
        assert "Traceback" not in server.log()
    finally:
        server.stop()
