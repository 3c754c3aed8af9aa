"""`engine serve --engine-process`: the engine in a process of its own, and what happens when it dies.

The request paths themselves run against this transport in tests/test_server.py (every test there
runs against both transports); here: the engine process is killed mid-stream, and a stopped server
leaves no engine process behind.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from server_helpers import MODEL, ServerProcess, start_server


def _engine_pid(server: ServerProcess) -> int:
    match = re.search(r"engine process (\d+) started", server.log())
    assert match, server.log()[-2000:]
    return int(match.group(1))


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_killed_engine_process_fails_open_requests_and_health() -> None:
    server = start_server("--engine-process", log_name="server-engine-killed")
    try:
        pid = _engine_pid(server)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    os.kill(pid, signal.SIGKILL)  # the engine dies mid-stream (an OOM kill, a crash)
        # The stream ended (no hang) with an error event naming what happened, not a normal [DONE].
        errors = [line for line in lines if line.startswith("data: ") and '"error"' in line]
        assert errors and "engine process exited unexpectedly" in errors[-1], lines[-3:]
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503
        refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "engine" in refused.json()["error"]["message"]
        assert server.process.poll() is None  # the server itself stays up, reporting unhealthy
    finally:
        server.stop()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_server_leaves_no_engine_process(how: signal.Signals) -> None:
    """A graceful stop stops the engine; a killed server closes the pipe, and the engine exits on that."""
    server = start_server("--engine-process", log_name=f"server-engine-{how.name.lower()}")
    pid = _engine_pid(server)
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert response.status_code == 200
    server.process.send_signal(how)
    assert server.process.wait(60) == (0 if how == signal.SIGTERM else -signal.SIGKILL)
    assert _gone(pid, 10), "the engine process outlived its server"


@pytest.mark.parametrize("target", ["group", "engine"])
def test_sigterm_stops_the_server_in_order(target: str) -> None:
    """SIGTERM to the whole process group (a terminal, `docker stop`, systemd), or to the engine process alone:
    the server leads one graceful shutdown (the running stream finishes), then stops the engine process, whose
    exit is no surprise. The log reads as a clean stop: no "exited unexpectedly", traceback or leaked semaphore."""
    server = start_server("--engine-process", log_name=f"server-sigterm-{target}", own_group=True)
    pid = _engine_pid(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    if target == "group":
                        os.killpg(server.process.pid, signal.SIGTERM)
                    else:
                        os.kill(pid, signal.SIGTERM)
    assert server.process.wait(60) == 0, server.log()[-3000:]
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2].replace(" ", "")
    assert _gone(pid, 10), "the engine process outlived its server"
    log = server.log()
    assert "the engine process got SIGTERM: the server shuts down" in log and "engine process stopped" in log
    for bad in ("unexpectedly", "Traceback", "leaked"):
        assert bad not in log, log[-3000:]


def test_a_model_that_does_not_load_is_one_error_line_from_the_engine_process(tmp_path) -> None:
    """The engine is built in the child: its ModelLoadError crosses the pipe and `engine serve` prints it
    as the usual single `error:` line with exit status 2, no traceback from either process."""
    from test_errors import assert_cli_error, run_cli

    missing = str(tmp_path / "no-such-model")
    result = run_cli("serve", "--engine-process", "--model", missing, "--port", "0")
    assert_cli_error(result, "does not exist", missing)
