"""Greedy requests against the real server (issue #48, items 2 and 4): no call may hold up a newcomer, and the
prefix cache is no side channel between salts.

Each attack is one well-formed but greedy call (n=128 with 300 tokens each; six 1,900-token prompts; echo with
20 prompt logprobs, n=1 and n=8); once it holds the engine, 3-token canaries are sent one at a time, and the
worst of them must be within CANARY_WORST_S (starvation would take tens of seconds). The attack's client then
hangs up and every KV page must come back.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess, shared_server
from test_server_errors import assert_openai_error

CANARY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
# Starvation, not speed: before issue #48 a canary waited 22-114 s behind these calls. The goal (2 s on
# a quiet CPU) is measured by benchmarks/hostile_floods.py (docs/benchmarks-log.md); here the suite shares two
# cores with other servers and engine processes, where a fair canary took up to 2.05 s.
CANARY_WORST_S = 4.0
LONG_PROMPT = "word " * 1890  # 1,891 tokens of SmolLM2's tokenizer


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server()


class HeldRequest:
    """A request on a raw socket that the test hangs up on when it is done with it."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(
            (
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n"
            ).encode()
            + payload
        )

    def hang_up(self) -> None:
        self.sock.close()


def _wait_for(condition: Callable[[dict[str, float]], bool], server: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition(server.metrics()):
        assert time.monotonic() < deadline, f"the attack never got going: {server.metrics()}"
        time.sleep(0.05)


def _canary_latencies(server: ServerProcess, count: int = 4) -> list[float]:
    seconds = []
    with httpx.Client(timeout=120) as client:
        for _ in range(count):
            start = time.monotonic()
            response = client.post(f"{server.base_url}/v1/completions", json=CANARY)
            seconds.append(time.monotonic() - start)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3, response.text
            time.sleep(0.25)
    return seconds


ATTACKS: dict[str, tuple[dict[str, Any], Callable[[dict[str, float]], bool]]] = {
    # Issue #48: a 3-token request sent 3 s later took 58 s (over 120 s with the test server's 8 slots).
    "n128": (
        {"prompt": "Tell me a story:", "n": 128, "max_tokens": 300, "ignore_eos": True},
        lambda m: m["engine:num_requests_running"] >= 8,
    ),
    # 72 s (29 s here): the prompts' prefill, one chunk after another, went first.
    "six1900": (
        {"prompt": [LONG_PROMPT] * 6, "max_tokens": 16, "ignore_eos": True},
        lambda m: m["engine:kv_pages_used"] > 0,
    ),
    # 43 s (22 s here), and over 60 s with n=8 (114 s here): prompt logprobs per choice, and the answer's
    # thousands of entries built on the thread that tokenizes every prompt.
    "echo": (
        {"prompt": LONG_PROMPT, "max_tokens": 1, "echo": True, "logprobs": 20},
        lambda m: m["engine:kv_pages_used"] > 0,
    ),
    "echo_n8": (
        {"prompt": LONG_PROMPT, "max_tokens": 1, "echo": True, "logprobs": 20, "n": 8},
        lambda m: m["engine:kv_pages_used"] > 0,
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_greedy_call_does_not_hold_up_a_canary(server: ServerProcess, attack: str) -> None:
    server.wait_idle()
    body, started = ATTACKS[attack]
    held = HeldRequest(server.port, body)
    try:
        _wait_for(started, server)
        if attack == "n128":
            # Issue #48: /metrics did not count requests queued for the engine; 120 of these wait.
            assert server.metrics()["engine:num_requests_pending"] >= 128
        seconds = _canary_latencies(server)
    finally:
        held.hang_up()
    assert max(seconds) <= CANARY_WORST_S, f"a canary waited {max(seconds):.2f} s behind {attack}: {seconds}"
    server.wait_idle(30)


def _unique_prompt(tag: str, words: int) -> str:
    return f"{tag} " + " ".join(f"w{i % 97}" for i in range(words))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_n_choices_computes_the_prompt_logprobs_once(server: ServerProcess, stream: bool) -> None:
    """Every choice gets the prompt's logprobs, equal to an n=1 echo's; the engine ran the prompt with logits at
    every position once (the other choices reuse its pages from the prefix cache)."""
    server.wait_idle()
    prompt = _unique_prompt(f"echo-{stream}-{time.time()}", 300)
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 3, "temperature": 0}
    single = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    prompt_tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}, timeout=30).json()["count"]
    computed = server.metrics()["engine:prefill_computed_tokens_total"]
    if stream:
        first: dict[int, dict[str, Any]] = {}
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json={**body, "n": 4, "stream": True}, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        first.setdefault(choice["index"], choice["logprobs"])
        echoed = [first[i] for i in range(4)]
    else:
        response = httpx.post(f"{server.base_url}/v1/completions", json={**body, "n": 4}, timeout=120)
        echoed = [choice["logprobs"] for choice in response.json()["choices"]]
    ran = server.metrics()["engine:prefill_computed_tokens_total"] - computed
    prompt_part = [{key: logprobs[key][:prompt_tokens] for key in logprobs} for logprobs in echoed]
    assert all(part == prompt_part[0] for part in prompt_part), "the choices' prompt logprobs differ"
    part = prompt_part[0]
    assert part["tokens"] == single["tokens"][:prompt_tokens]
    assert part["text_offset"] == single["text_offset"][:prompt_tokens]
    assert part["token_logprobs"][0] is None and single["token_logprobs"][0] is None
    # The same logprobs as an n=1 echo, up to float32 rounding: its prompt ran in chunks of other sizes (the
    # time budget's), which moves a logprob by up to ~2e-3 here; a shifted or missing entry is off by far more.
    assert part["token_logprobs"][1:] == pytest.approx(single["token_logprobs"][1:prompt_tokens], abs=1e-2)
    # Once with logprobs, then at most a page and the last token again for each of the three others.
    assert ran <= prompt_tokens + 3 * 17, (ran, prompt_tokens)
    server.wait_idle()


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_cache_salt_must_be_a_non_empty_string(server: ServerProcess, salt: Any) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "cache_salt": salt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}),
    ):
        error = assert_openai_error(httpx.post(f"{server.base_url}{path}", json=body, timeout=30), 400)
        assert error["param"] == "cache_salt" and "cache_salt" in error["message"], error
        accepted = httpx.post(f"{server.base_url}{path}", json={**body, "cache_salt": "x", "max_tokens": 1}, timeout=60)
        assert accepted.status_code == 200, accepted.text


def test_the_metrics_side_channel_is_closed_by_a_cache_salt(server: ServerProcess) -> None:
    """Issue #48: anyone who reads /metrics could tell whether a guessed prompt was cached by another client.
    With a salt per tenant a guess under another salt (or none) is never a hit; under its own salt it is."""
    server.wait_idle()
    secret = _unique_prompt(f"The launch code is {time.time()}", 120)

    def hits_after(prompt: str, salt: str | None, chat: bool = False) -> float:
        before = server.metrics()["engine:prefix_cache_hits_total"]
        extra = {"cache_salt": salt} if salt is not None else {}
        if chat:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, **extra}
            response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        else:
            body = {"prompt": prompt, "max_tokens": 1, **extra}
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        server.wait_idle()
        return server.metrics()["engine:prefix_cache_hits_total"] - before

    assert hits_after(secret, "tenant-a") == 0
    assert hits_after(secret, "tenant-b") == 0  # the probe of another tenant learns nothing
    assert hits_after(secret, None) == 0
    assert hits_after(secret, "tenant-a") >= 112  # its own tenant reuses its pages
    assert hits_after(secret, "tenant-c", chat=True) == 0
    assert hits_after(secret, "tenant-c", chat=True) >= 112


def test_a_canary_is_admitted_while_eight_streams_of_one_call_decode(server: ServerProcess) -> None:
    """The n128 attack as a stream (its choices interleaved on one connection), with the canary streamed too:
    the canary's first token comes within the bound."""
    server.wait_idle()
    body = {"prompt": "Count:", "n": 32, "max_tokens": 300, "ignore_eos": True, "stream": True}
    stop = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        _wait_for(lambda m: m["engine:num_requests_running"] >= 8, server)
        start = time.monotonic()
        first_token = None
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json={**CANARY, "stream": True}, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and first_token is None:
                    first_token = time.monotonic() - start
        assert first_token is not None and first_token <= CANARY_WORST_S, first_token
    finally:
        stop.set()
        reader.join(60)
    server.wait_idle(30)
