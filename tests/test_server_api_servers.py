"""`engine serve --api-server-count 2`: two API-server processes on one socket over one engine process.

Requests through either process get the engine's tokens; /metrics sums the counters of both, whichever answers
the scrape; a LoRA-free server lists the same model from both. An API server killed mid-stream has its requests
aborted by the engine (every KV page back) while the other keeps serving; a SIGTERM to the main process alone
drains and stops them all, exit status 0.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest
from server_helpers import MODEL, ServerProcess, start_server

PROMPT = "The capital of France is"


def _complete(server: ServerProcess, stream: bool = False, max_tokens: int = 6) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if not stream:
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return str(response.json()["choices"][0]["text"])
    text = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(re.search(r'"text": ?"((?:[^"\\]|\\.)*)"', line).group(1))  # type: ignore[union-attr]
    return "".join(text).encode().decode("unicode_escape")


def _served_by_second_process(server: ServerProcess) -> int:
    """Requests the second API server answered, by its tagged access lines in the log."""
    return len(re.findall(r"\[api-server 1\].*POST /v1/completions", server.log()))


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    process = start_server("--api-server-count", "2", "--debug-kv-invariant", log_name="server-api2", own_group=True)
    yield process
    process.stop()


def test_both_processes_serve_the_engines_tokens_and_metrics_sum_them(server: ServerProcess) -> None:
    want = _complete(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: _complete(server, stream=i % 2 == 1), range(16)))
    assert texts == [want] * 16
    # Each request is a new connection, which the kernel gives either process: go on until the second has one.
    sent = 17
    while _served_by_second_process(server) == 0 and sent < 300:
        assert _complete(server) == want
        sent += 1
    assert _served_by_second_process(server) > 0, server.log()[-3000:]
    assert _served_by_second_process(server) < sent
    for _ in range(4):  # whichever process answers the scrape, the counters are both processes' sum
        assert server.wait_idle()["engine:request_success_total:length"] == sent
    models = {tuple(m["id"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]) for _ in range(8)}
    assert models == {(MODEL,)}


def test_a_killed_api_server_has_its_requests_aborted_and_the_other_serves_on(server: ServerProcess) -> None:
    second = int(re.search(r"more API-server processes started: \[(\d+)\]", server.log()).group(1))  # type: ignore[union-attr]
    before = len(re.findall(r"API server 1 closed its pipe: ", server.log()))
    # Long streams from both processes, then the second process dies under its own.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_complete, server, True, 400) for _ in range(8)]
        time.sleep(3)
        os.kill(second, signal.SIGKILL)
        ended = [future.exception(timeout=180) for future in streams]  # none hangs: each ends, or its server died
    # The engine sees the pipe end once every process holding it has exited (under load, seconds later).
    deadline = time.monotonic() + 60
    while (
        len(aborted := re.findall(r"API server 1 closed its pipe: (\d+) of its requests aborted", server.log()))
        == before
    ):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.2)
    time.sleep(1)  # what the dead server's helper processes print on their way out, before the next test reads
    assert len(aborted) == before + 1, server.log()[-3000:]
    assert sum(error is not None for error in ended) == int(aborted[-1])  # the dead server's streams, and only those
    server.wait_idle()  # the dead server's requests aborted: no request left, every KV page free
    assert _complete(server) == _complete(server)  # the main process serves on
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_sigterm_to_the_main_process_alone_stops_every_process(server: ServerProcess) -> None:
    group = os.getpgid(server.process.pid)
    before = len(server.log())  # (the previous test's SIGKILL may have cut a grammar worker's start: its trace)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.log()[-3000:]
    deadline = time.monotonic() + 30
    while os.popen(f"pgrep -g {group}").read().split() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.popen(f"pgrep -g {group}").read().split(), "processes of the server left running"
    log = server.log()[before:]
    assert "engine process stopped" in log and "Traceback" not in log, log[-3000:]
