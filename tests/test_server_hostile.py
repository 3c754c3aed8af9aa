"""The server under attack: every hostile request is a 4xx in OpenAI's shape, and no client costs another.

Against the real `engine serve` process (server_helpers): a table of hostile bodies, raw HTTP
(idle sockets, slowloris, a 100 MB body), clients that hang up on non-streaming requests, poisoned
requests beside healthy ones, and a soak. In-process (TestClient): auth before work.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import resource
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import MODEL, ServerProcess, shared_server
from test_server_errors import CASES as BASIC_CASES
from test_server_errors import _send, assert_openai_error

from engine.engine import Engine
from engine.scheduler import LONE_EXTEND_STEP_S
from engine.server.app import ServerSettings, build_app

MSG = [{"role": "user", "content": "hi"}]
SURROGATE = "\ud800"


def _nested_arrays(levels: int) -> dict[str, Any]:
    """A JSON schema nesting `levels` deep: issue #48's attack is 900 (25 KB; 73 s to parse and compile)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _wide_object(properties: int, tag: str) -> dict[str, Any]:
    """Within every size and depth limit, slow to compile: 2,000 properties (99 KB) take ~28 s of CPU."""
    fields = {f"{tag}_{i}": {"type": ["string", "integer", "null"]} for i in range(properties)}
    return {"type": "object", "properties": fields}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# Sampling poisons, each sent to both endpoints.
POISONED_FIELDS: list[tuple[str, Any]] = [
    ("temperature", "NaN"),
    ("temperature", "Infinity"),
    ("temperature", "-Infinity"),
    ("temperature", -1e-300),
    ("top_k", 2**63),
    ("top_k", 2**31),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_p", "NaN"),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("min_p", "NaN"),
    ("min_p", -0.1),
    ("min_p", 2),
    ("repetition_penalty", "NaN"),
    ("repetition_penalty", 1e-300),
    ("repetition_penalty", "Infinity"),
    ("repetition_penalty", 1e6),
    ("repetition_penalty", -1),
    ("presence_penalty", "NaN"),
    ("presence_penalty", 2.5),
    ("frequency_penalty", "-Infinity"),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("seed", -(2**64)),
    ("n", "2"),
    ("n", 1.0),
    ("n", True),
    ("n", -1),
    ("max_tokens", 1.0),
    ("max_tokens", "5"),
    ("max_tokens", True),
    ("max_tokens", 2**70),
    ("stop", ["x"] * 100),
    ("stop", ["y" * 5000]),
    ("stop", [1, 2]),
    ("stop", {"a": 1}),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", list(range(2000))),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("stream", "true"),
    ("skip_special_tokens", 0),
]


def _raw_json(body: dict[str, Any]) -> str:
    """JSON with NaN/Infinity spelled as bare tokens, as a hostile client sends them."""
    text = json.dumps(body)
    for token in ("NaN", "Infinity", "-Infinity"):
        text = text.replace(f'"{token}"', token)
    return text


def _poison_cases() -> list[tuple[str, str, str, Any, int]]:
    cases = []
    for name, value in POISONED_FIELDS:
        cases.append(
            (
                f"completions {name}={value!r}"[:60],
                "POST",
                "/v1/completions",
                _raw_json({"prompt": "hi", name: value}),
                400,
            )
        )
        cases.append(
            (
                f"chat {name}={value!r}"[:60],
                "POST",
                "/v1/chat/completions",
                _raw_json({"messages": MSG, name: value}),
                400,
            )
        )
    return cases


OTHER_CASES: list[tuple[str, str, str, Any, int]] = [
    # Unencodable text anywhere: 400 naming the field, never a 500.
    ("surrogate prompt", "POST", "/v1/completions", {"prompt": SURROGATE}, 400),
    ("surrogate in a prompt list", "POST", "/v1/completions", {"prompt": ["ok", "a" + SURROGATE]}, 400),
    ("surrogate model", "POST", "/v1/completions", {"prompt": "hi", "model": SURROGATE}, 400),
    ("surrogate stop", "POST", "/v1/completions", {"prompt": "hi", "stop": [SURROGATE]}, 400),
    (
        "surrogate chat content",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SURROGATE}]},
        400,
    ),
    (
        "surrogate chat part",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" + SURROGATE}]}]},
        400,
    ),
    (
        "surrogate chat name",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]},
        400,
    ),
    ("surrogate field name", "POST", "/v1/completions", {"prompt": "hi", SURROGATE: 1}, 400),
    ("surrogate tokenize", "POST", "/tokenize", {"prompt": SURROGATE}, 400),
    ("surrogate tokenize messages", "POST", "/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, 400),
    # Strict types for token ids and counts.
    ("bool token ids", "POST", "/v1/completions", {"prompt": [True, False]}, 400),
    ("float token ids", "POST", "/v1/completions", {"prompt": [1.0, 2.0]}, 400),
    ("string token ids", "POST", "/v1/completions", {"prompt": [["1", "2"]]}, 400),
    ("mixed token ids", "POST", "/v1/completions", {"prompt": [1, "a"]}, 400),
    ("nested too deep", "POST", "/v1/completions", {"prompt": [[[1]]]}, 400),
    ("detokenize bools", "POST", "/detokenize", {"tokens": [True]}, 400),
    ("detokenize floats", "POST", "/detokenize", {"tokens": [1.5]}, 400),
    ("detokenize too many", "POST", "/detokenize", {"tokens": [1] * 5000}, 400),
    ("logprobs true (completions)", "POST", "/v1/completions", {"prompt": "hi", "logprobs": True}, 400),
    ("echo a string", "POST", "/v1/completions", {"prompt": "hi", "echo": "yes"}, 400),
    ("chat logprobs 1", "POST", "/v1/chat/completions", {"messages": MSG, "logprobs": 1}, 400),
    ("role a number", "POST", "/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, 400),
    (
        "content a dict",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": {"text": "hi"}}]},
        400,
    ),
    (
        "part without text",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
    ),
    ("messages null", "POST", "/v1/chat/completions", {"messages": None}, 400),
    ("stream_options a list", "POST", "/v1/completions", {"prompt": "hi", "stream_options": [1]}, 400),
    # Sizes: text that cannot fit the context is refused before tokenizing.
    ("prompt of 2M characters", "POST", "/v1/completions", {"prompt": "a" * 2_000_000, "max_tokens": 1}, 400),
    (
        "chat of 2M characters",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "b" * 2_000_000}]},
        400,
    ),
    ("tokenize 2M characters", "POST", "/tokenize", {"prompt": "c" * 2_000_000}, 400),
    ("1000 prompts", "POST", "/v1/completions", {"prompt": ["hi"] * 1000, "max_tokens": 1}, 400),
    ("n x prompts over the cap", "POST", "/v1/completions", {"prompt": ["hi"] * 20, "n": 10, "max_tokens": 1}, 400),
    # Request-supplied chat templates and reserved template arguments.
    (
        "request chat template",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}},
        400,
    ),
    (
        "template kwarg tokenize",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "chat_template_kwargs": {"tokenize": False}},
        400,
    ),
    (
        "template kwarg conversation",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "chat_template_kwargs": {"conversation": []}},
        400,
    ),
    ("template kwargs a list", "POST", "/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": [1]}, 400),
    # Routes.
    ("unknown model retrieve", "GET", "/v1/models/gpt-9", None, 404),
    ("docs are off", "GET", "/docs", None, 404),
    ("openapi is off", "GET", "/openapi.json", None, 404),
    ("redoc is off", "GET", "/redoc", None, 404),
    ("delete a model", "DELETE", "/v1/models", None, 405),
    ("put completions", "PUT", "/v1/completions", {"prompt": "hi"}, 405),
    ("path traversal", "GET", "/../../etc/passwd", None, 404),
    ("null body", "POST", "/v1/completions", "null", 400),
    ("number body", "POST", "/v1/completions", "42", 400),
    ("deeply nested json", "POST", "/v1/completions", "[" * 100_000 + "]" * 100_000, 400),
    ("invalid utf-8 body", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("NaN bare in prompt list", "POST", "/v1/completions", '{"prompt": [NaN]}', 400),
    # Grammars (issue #48): refused by the limits before any parse, or by the compiler process, never a 500.
    (
        "schema of arrays 900 deep",
        "POST",
        "/v1/completions",
        {"prompt": "hi", "response_format": _schema_format(_nested_arrays(900))},
        400,
    ),
    ("schema text too deep to read", "POST", "/v1/completions", {"prompt": "hi", "json_schema": "[" * 10**5}, 400),
    ("regex 100 groups deep", "POST", "/v1/completions", {"prompt": "hi", "regex": "(" * 100 + ")" * 100}, 400),
    ("regex over a megabyte", "POST", "/v1/completions", {"prompt": "hi", "regex": "a" * (2**20 + 1)}, 400),
    ("regex of no character", "POST", "/v1/completions", {"prompt": "hi", "regex": "[^\\s\\S]", "max_tokens": 3}, 400),
    (
        "schema pattern of no character",
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": _schema_format({"type": "string", "pattern": "[^\\s\\S]"})},
        400,
    ),
    ("ebnf of no character", "POST", "/v1/completions", {"prompt": "hi", "ebnf": "root ::= [^\\0-\\U0010FFFF]"}, 400),
]

CASES = BASIC_CASES + _poison_cases() + OTHER_CASES
LEAKS = ("Traceback", "/work/", "site-packages", 'File "', '.py"', "line ")


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server()


def _send_any(base: str, method: str, path: str, body: Any) -> httpx.Response:
    """Bodies as raw bytes: dicts through json.dumps, which writes a lone surrogate as the escape "\\ud800"."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    if isinstance(body, bytes):
        return httpx.request(
            method, base + path, content=body, headers={"content-type": "application/json"}, timeout=60
        )
    return _send(base, method, path, body)


def test_hostile_request_table(server: ServerProcess) -> None:
    assert len(CASES) >= 150, len(CASES)
    failures = []
    for name, method, path, body, status in CASES:
        response = _send_any(server.base_url, method, path, body)
        try:
            error = assert_openai_error(response, status)
            leaked = [needle for needle in LEAKS if needle in error["message"]]
            assert not leaked, f"message leaks {leaked}: {error['message'][:200]}"
        except (AssertionError, json.JSONDecodeError) as exc:
            failures.append(f"{name}: {str(exc)[:300]}")
    assert not failures, f"{len(failures)} of {len(CASES)} failed:\n" + "\n".join(failures)
    server.wait_idle()
    ok = _send(server.base_url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()


def test_model_can_be_retrieved(server: ServerProcess) -> None:
    card = httpx.get(f"{server.base_url}/v1/models/{MODEL}", timeout=10).json()
    assert card["id"] == MODEL and card["object"] == "model"


def _greedy(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def add(a, b):",
    "Water boils at",
    "The quick brown fox",
    "My favourite colour is",
    "In 1969,",
]


@pytest.mark.parametrize(
    "poison",
    [
        ("temperature", "NaN"),
        ("temperature", 1e-37),
        ("top_k", 2**63),
        ("top_p", 1e-300),
        ("repetition_penalty", "NaN"),
        ("repetition_penalty", 1e-300),
    ],
)
def test_one_poisoned_request_among_eight_costs_the_others_nothing(
    server: ServerProcess, poison: tuple[str, Any]
) -> None:
    """8 requests arrive together, one poisoned: the 7 others get exactly their solo tokens."""
    solo = {
        p: _send(server.base_url, "POST", "/v1/completions", _greedy(p)).json()["choices"][0]["text"] for p in PROMPTS
    }
    name, value = poison
    bad = _raw_json({"prompt": "Poison", "max_tokens": 8, "ignore_eos": True, name: value})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        poisoned = pool.submit(_send, server.base_url, "POST", "/v1/completions", bad)
        healthy = {p: pool.submit(_send, server.base_url, "POST", "/v1/completions", _greedy(p)) for p in PROMPTS}
        response = poisoned.result()
        for prompt, future in healthy.items():
            result = future.result()
            assert result.status_code == 200, result.text
            assert result.json()["choices"][0]["text"] == solo[prompt]
    if (name, value) in (("temperature", 1e-37), ("top_p", 1e-300)):
        assert response.status_code == 200  # legal: greedy (tiny temperature) or the top token only
    else:
        assert_openai_error(response, 400)
    server.wait_idle()


def _running(server: ServerProcess) -> float:
    return server.metrics()["engine:num_requests_running"]


def test_non_streaming_clients_that_hang_up_are_aborted_within_a_second(server: ServerProcess) -> None:
    server.wait_idle()
    body = json.dumps({"prompt": "Tell me everything", "max_tokens": 1500, "ignore_eos": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sockets = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(request)
        sockets.append(sock)
    deadline = time.monotonic() + 30
    while _running(server) < 4:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.05)
    time.sleep(0.5)  # decoding now
    for sock in sockets:
        sock.close()
    hung_up = time.monotonic()
    while _running(server) > 0:
        assert time.monotonic() - hung_up < 1.0, "abandoned requests still running"
        time.sleep(0.05)
    assert time.monotonic() - hung_up <= 1.0
    values = server.wait_idle(5)
    assert values["engine:kv_pages_used"] == 0


def test_512_concurrent_clients_are_all_served(server: ServerProcess) -> None:
    """512 connections at once, each a short streamed request: every one answered, the pool back to 0."""
    import asyncio

    _raise_client_fd_limit(4096)

    async def one(client: httpx.AsyncClient, index: int) -> int:
        body = {"prompt": f"Client {index}:", "max_tokens": 1, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and lines[-1] == "data: [DONE]"
        return response.status_code

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(512)))

    assert asyncio.run(main()) == [200] * 512
    assert server.wait_idle(30)["engine:kv_pages_used"] == 0


def _raise_client_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


@pytest.mark.parametrize("count", [1100, 10_000])
def test_idle_sockets_do_not_lock_out_new_clients(server: ServerProcess, count: int) -> None:
    """Issue #48: past the connection cap new clients got a 503 until the idle sockets timed out. Now a newcomer
    takes the oldest idle socket's place: /health and a completion answer within a second, however many."""
    _raise_client_fd_limit(count + 2048)
    idle = []
    try:
        for _ in range(count):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        start = time.monotonic()
        response = httpx.get(f"{server.base_url}/health", timeout=5)
        assert response.status_code == 200 and time.monotonic() - start < 1.0
        start = time.monotonic()
        response = httpx.post(f"{server.base_url}/v1/completions", json=CANARY, timeout=5)
        assert response.status_code == 200 and time.monotonic() - start < 1.0, response.text
    finally:
        for sock in idle:
            sock.close()


def test_eight_8mb_token_id_bodies_do_not_stall_health(server: ServerProcess) -> None:
    """Issue #48: eight concurrent 8.2 MB token-id bodies, parsed and validated on the event loop, held /health
    for 6.2 s. Now large bodies are parsed on a thread of their own: each is a 400 (longer than the context) and
    /health stays fast."""
    server.wait_idle()
    ids = [1000 + i % 9000 for i in range(1_640_000)]
    body = json.dumps({"prompt": ids, "max_tokens": 1}, separators=(",", ":")).encode()
    assert 8_000_000 < len(body) < 8 * 2**20
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(
                httpx.post,
                f"{server.base_url}/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            )
            for _ in range(8)
        ]
        latencies = []
        while not all(f.done() for f in futures):
            start = time.monotonic()
            assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    for future in futures:
        error = assert_openai_error(future.result(), 400)
        assert error["param"] == "prompt", error
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s beside the bodies: {sorted(latencies)[-5:]}"


def test_slowloris_headers_are_cut_off_at_the_header_timeout(server: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    start = time.monotonic()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        received = b""
        while time.monotonic() - start < 8:
            try:
                sock.sendall(b"X-a: b\r\n")  # one header line every 0.3 s, never the blank line
            except OSError:
                break
            sock.settimeout(0.3)
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break  # closed with our header lines unread: the kernel answers with a reset
            if not chunk:
                break
            received += chunk
        assert time.monotonic() - start < 6, "the slow client was not cut off"
        assert received.startswith(b"HTTP/1.1 408") or received == b""
    finally:
        sock.close()
    assert httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200


def test_a_100_mb_body_gets_413_before_it_is_sent(server: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 104857600\r\n\r\n{"prompt": "'
        )
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"connection: close" in answer.lower()
    finally:
        sock.close()


def test_unknown_host_header_is_refused(server: ServerProcess) -> None:
    """The server is bound to loopback: a rebound DNS name must not reach it."""
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Host": "evil.example"}, timeout=10)
    assert_openai_error(response, 400)
    assert (
        httpx.get(f"{server.base_url}/v1/models", headers={"Host": f"localhost:{server.port}"}, timeout=10).status_code
        == 200
    )


def test_health_answers_while_a_huge_prompt_is_tokenized(server: ServerProcess) -> None:
    """Tokenizing runs off the event loop: /health stays fast while the largest legal prompt is processed."""
    prompt = "word " * 12_000  # just under the character limit, over the context in tokens: a 400 after tokenizing
    result: dict[str, Any] = {}

    def send() -> None:
        result["response"] = _send(server.base_url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    while thread.is_alive():
        start = time.monotonic()
        httpx.get(f"{server.base_url}/health", timeout=5)
        latencies.append(time.monotonic() - start)
    thread.join()
    assert_openai_error(result["response"], 400)
    # The loop answers in a few ms; the bound is loose for a loaded 2-core box (the engine thread and
    # the tokenizer thread share it), and still far below the seconds a tokenize on the loop took.
    assert max(latencies) < 0.5, latencies


def test_auth_is_checked_before_the_body_is_read(smol_engine: Engine) -> None:
    app = build_app(smol_engine, settings=ServerSettings(api_key="s3cret"))
    good = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as http:
        assert_openai_error(
            http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 401
        )
        assert_openai_error(http.post("/tokenize", json={"prompt": "hi"}), 401)
        assert_openai_error(http.post("/detokenize", json={"tokens": [1]}), 401)
        assert_openai_error(http.get("/metrics"), 401)
        assert_openai_error(http.get("/v1/models/" + MODEL), 401)
        assert_openai_error(http.get("/docs"), 401)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics", headers=good).status_code == 200
        assert_openai_error(http.get("/docs", headers=good), 404)
    opened = build_app(smol_engine, settings=ServerSettings(api_key="s3cret", open_metrics=True, enable_docs=True))
    with TestClient(opened) as http:
        assert http.get("/metrics").status_code == 200
        assert_openai_error(http.get("/openapi.json"), 401)  # docs on, but behind the key
        assert http.get("/openapi.json", headers=good).status_code == 200


def test_queue_limit_answers_503_with_retry_after(smol_engine: Engine) -> None:
    app = build_app(smol_engine, settings=ServerSettings(max_pending_requests=2))
    with TestClient(app) as http:
        response = http.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 1})
        assert_openai_error(response, 503)
        assert response.headers["retry-after"] == "1"
        ok = http.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    assert smol_engine.kv_pages_in_use() == 0


def test_an_unexpected_error_is_json_and_closes_the_connection(smol_engine: Engine) -> None:
    app = build_app(smol_engine)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("/secret/path/file.py exploded")

    with TestClient(app) as http:
        response = http.get("/boom")
        error = assert_openai_error(response, 500)
        assert "/secret" not in error["message"] and response.headers["connection"] == "close"


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# 300 requests by default: enough for ~60 hang-ups and ~15 hostile requests after the baseline batch, where a leak
# of a descriptor, a page or a buffer per request shows; ENGINE_SOAK_REQUESTS=2000 soaks longer by hand.
SOAK_REQUESTS = int(os.environ.get("ENGINE_SOAK_REQUESTS", "300"))
SOAK_BATCH = 100


def test_soak_with_disconnects_and_hostile_requests(server: ServerProcess) -> None:
    """300 requests, 20% hanging up, 5% hostile: pool back to 0, descriptors flat, RSS within 10%."""
    rng = random.Random(5)
    pid = server.process.pid
    hostile = [
        case for case in CASES if case[4] == 400 and case[2].startswith("/v1/") and not isinstance(case[3], bytes)
    ]

    def one(index: int) -> str:
        kind = rng.random()
        if kind < 0.05:
            _name, method, path, body, status = hostile[index % len(hostile)]
            assert _send_any(server.base_url, method, path, body).status_code == status
            return "hostile"
        body = {
            "prompt": f"Request {index} says",
            "max_tokens": 1 + index % 4,
            "ignore_eos": True,
            "stream": index % 3 == 0,
        }
        if kind < 0.25:
            with contextlib.suppress(httpx.TimeoutException):  # hangs up before the answer
                httpx.post(f"{server.base_url}/v1/completions", json={**body, "max_tokens": 64}, timeout=0.05)
            return "hung up"
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return "ok"

    baseline_rss = baseline_fds = 0
    counts: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for start in range(0, SOAK_REQUESTS, SOAK_BATCH):
            for outcome in pool.map(one, range(start, min(start + SOAK_BATCH, SOAK_REQUESTS))):
                counts[outcome] = counts.get(outcome, 0) + 1
            if start == 0:
                server.wait_idle(30)
                baseline_rss, baseline_fds = _rss_kb(pid), _open_fds(pid)
    values = server.wait_idle(30)
    assert values["engine:kv_pages_used"] == 0
    assert counts.get("hung up", 0) > SOAK_REQUESTS // 10 and counts.get("hostile", 0) > 0
    time.sleep(1.0)  # let the keep-alive and header timeouts close what the clients left open
    print(f"soak: {counts}; fds {baseline_fds} -> {_open_fds(pid)}; RSS {baseline_rss} -> {_rss_kb(pid)} KiB")
    assert _open_fds(pid) <= baseline_fds + 16, (baseline_fds, _open_fds(pid))
    assert _rss_kb(pid) <= 1.10 * baseline_rss, (baseline_rss, _rss_kb(pid))


def test_a_heavy_request_does_not_stall_a_running_stream(server: ServerProcess) -> None:
    """Long prompts with echo and 20 logprobs beside a stream: the stream never waits more than 1.5 s.

    The stall this guards against (the echo's logprob JSON built on the event loop) is several seconds;
    the gaps it allows are the heavy prompts' own extend steps, which on these 2-core machines take
    0.6-1.1 s (one CI run of 2026-12-02 saw 1.09 s against the old 1.0 s bound)."""
    server.wait_idle()
    arrivals: list[float] = []
    heavy_started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Count slowly:", "max_tokens": 160, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        heavy_started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert heavy_started.wait(60)
    heavy = {"prompt": ["word " * 1400] * 4, "max_tokens": 1, "echo": True, "logprobs": 20}
    heavy_start = time.monotonic()
    response = httpx.post(f"{server.base_url}/v1/completions", json=heavy, timeout=600)
    heavy_end = time.monotonic()
    reader.join(300)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["tokens"]) > 1400
    during = [b - a for a, b in itertools.pairwise(arrivals) if heavy_start <= b <= heavy_end]
    assert during, "the stream ended before the heavy request began"
    assert max(during) <= 1.5, f"stream stalled {max(during):.2f} s by a heavy request (gaps: {sorted(during)[-5:]})"


@pytest.mark.parametrize("text", ["日本語の文章", "héllo wörld ñ", "emoji 🙂🚀 end", "Ελληνικά και русский"])
def test_logprob_tokens_join_to_the_text_and_bytes_are_the_tokens_own(server: ServerProcess, text: str) -> None:
    """Characters split over tokens: token texts still join to the text; `bytes` are each token's raw bytes."""
    echo = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": text, "max_tokens": 1, "echo": True, "logprobs": 2, "temperature": 0},
        timeout=60,
    ).json()
    choice = echo["choices"][0]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert "\ufffd" not in "".join(choice["logprobs"]["tokens"][:-1])
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": f"Repeat exactly: {text}"}],
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 2,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    message = chat["choices"][0]["message"]["content"]
    assert "".join(entry["token"] for entry in content) == message
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8", errors="replace") == message


@pytest.mark.parametrize("stream", [False, True])
def test_clients_that_hang_up_during_prefill_free_everything(server: ServerProcess, stream: bool) -> None:
    """A long prompt still in its prefill when the client leaves is aborted, and its pages freed, once the step
    in flight ends. A prompt alone runs in steps of up to LONE_EXTEND_STEP_S (2 s, by the scheduler's estimate;
    more on a busy machine), so the abort must come within a few seconds; without it the request would go on to
    800 decode steps (the context is 2,048 tokens), far longer. /metrics is refreshed only between steps, so the
    test goes by the abort counter, not by seeing the prefill's pages."""
    server.wait_idle()
    metrics = server.metrics()
    aborts_before = metrics.get("engine:request_success_total:abort", 0)
    generated_before = metrics.get("engine:generation_tokens_total", 0)
    prompt = ("river " if stream else "story ") * 1800  # each case its own prompt: no prefix-cache hits
    body = json.dumps({"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": stream}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(request)
    deadline = time.monotonic() + 30
    while server.metrics().get("engine:num_requests_pending", 0) < 1:  # the server has it: tokenized, sent on
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    time.sleep(0.2)  # into its first prefill step (1,800 tokens take over a second here)
    sock.close()
    hung_up = time.monotonic()
    allowed = 3 * LONE_EXTEND_STEP_S + 2.0
    while server.metrics().get("engine:request_success_total:abort", 0) == aborts_before:
        waited = time.monotonic() - hung_up
        assert waited < allowed, f"no abort {waited:.1f} s after the client left during its prefill"
        time.sleep(0.02)
    server.wait_idle(10)
    metrics = server.metrics()
    assert metrics["engine:kv_pages_used"] == 0
    # Aborted long before its 200 tokens (a few decode steps may run while the server notices the hang-up).
    assert metrics.get("engine:generation_tokens_total", 0) - generated_before < 100


# ---- grammars (issue #48): each attack with a well-formed canary beside it -------------------------------------

CANARY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
# Starvation, not speed: before issue #48 a canary waited 34-60 s behind these grammars. The 2 s goal on a quiet
# CPU is measured by benchmarks/hostile_grammars.py; the suite shares two cores with other servers.
CANARY_WORST_S = 4.0


@contextlib.contextmanager
def _canaries(server: ServerProcess) -> Any:
    """While the block runs, one request at a time: a plain completion, then one with a small schema never seen
    before (it needs a check and a compile of its own), and so on. Yields the (kind, seconds, status) list."""
    seen: list[tuple[str, float, int]] = []
    stop = threading.Event()
    # The compiler processes start with the server, in the background: one schema request first, so that what
    # is timed below is waiting behind the attack, not a cold start of the processes on a busy CPU.
    warm = dict(CANARY, response_format=_schema_format({"type": "object", "properties": {"warm": {"type": "integer"}}}))
    assert httpx.post(f"{server.base_url}/v1/completions", json=warm, timeout=60).status_code == 200

    def loop() -> None:
        for index in itertools.count():
            if stop.is_set():
                return
            body: dict[str, Any] = dict(CANARY)
            if index % 2:
                schema = {"type": "object", "properties": {f"canary_{index}_{random.random()}": {"type": "integer"}}}
                body["response_format"] = _schema_format(schema)
            start = time.monotonic()
            status = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code
            seen.append(("schema" if index % 2 else "plain", time.monotonic() - start, status))

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(120)


def _assert_canaries_were_served(seen: list[tuple[str, float, int]]) -> None:
    assert {kind for kind, _, _ in seen} == {"plain", "schema"}, seen
    assert all(status == 200 for _, _, status in seen), seen
    for kind in ("plain", "schema"):
        worst = max(seconds for k, seconds, _ in seen if k == kind)
        assert worst <= CANARY_WORST_S, f"a {kind} canary waited {worst:.2f} s behind the attack: {seen}"


def _hang_up_after(port: int, body: dict[str, Any], seconds: float) -> None:
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + payload)
        time.sleep(seconds)


def test_three_schemas_900_deep_at_once_are_refused_by_the_depth_limit_beside_a_canary(server: ServerProcess) -> None:
    """Issue #48: each took 73 s to parse and compile on threads every request shares; a plain request beside
    three timed out at 60 s. Now each is a 400 naming the limit before anything parses it."""
    server.wait_idle()
    body = {"prompt": "hi", "max_tokens": 3, "response_format": _schema_format(_nested_arrays(900))}
    with _canaries(server) as seen, concurrent.futures.ThreadPoolExecutor(3) as pool:
        time.sleep(0.3)
        responses = list(pool.map(lambda _: _send_any(server.base_url, "POST", "/v1/completions", body), range(3)))
        time.sleep(1.0)
    for response in responses:
        error = assert_openai_error(response, 400)
        assert error["param"] == "response_format", error
        assert "nests 900 levels deep; at most 64 (--grammar-max-depth)" in error["message"], error
    _assert_canaries_were_served(seen)
    server.wait_idle()


def test_grammars_past_the_compile_deadline_are_refused_and_delay_no_one(server: ServerProcess) -> None:
    """Three schemas within every size and depth limit that take ~28 s each to compile: killed at the 5 s CPU
    deadline, a 400 "grammar too complex" each; plain and schema canaries beside them stay fast."""
    server.wait_idle()
    before = server.metrics()
    timed_out = before["engine:grammar_checks_timed_out_total"]
    bodies = [
        {"prompt": "hi", "max_tokens": 3, "response_format": _schema_format(_wide_object(2000, f"deadline{i}"))}
        for i in range(3)
    ]
    with _canaries(server) as seen, concurrent.futures.ThreadPoolExecutor(3) as pool:
        time.sleep(0.3)
        responses = list(pool.map(lambda b: _send_any(server.base_url, "POST", "/v1/completions", b), bodies))
    for response in responses:
        error = assert_openai_error(response, 400)
        assert error["message"] == (
            "response_format: grammar too complex: the json schema did not compile within 5 s "
            "(--grammar-compile-timeout)"
        ), error
    _assert_canaries_were_served(seen)
    after = server.metrics()
    assert after["engine:grammar_checks_timed_out_total"] == timed_out + 3
    # Each ran past 0.5 s of CPU at the lowest priority, so the canaries' small schemas were checked first.
    assert after["engine:grammar_checks_demoted_total"] == before["engine:grammar_checks_demoted_total"] + 3
    server.wait_idle()


def test_grammar_checks_of_clients_that_hang_up_are_cancelled_at_once(server: ServerProcess) -> None:
    """Issue #48: twenty slow schemas whose clients left after 0.3 s were all still parsed and compiled, and
    the next request waited 47 s. Now the queued checks are dropped and the running ones' processes killed."""
    server.wait_idle()
    cancelled = server.metrics()["engine:grammar_checks_cancelled_total"]
    bodies = [
        {"prompt": "hi", "max_tokens": 3, "response_format": _schema_format(_wide_object(2000, f"left{i}"))}
        for i in range(20)
    ]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda b: _hang_up_after(server.port, b, 0.3), bodies))
    hung_up = time.monotonic()
    while True:
        values = server.metrics()
        if values["engine:grammar_checks_running"] == 0 and values["engine:grammar_checks_queued"] == 0:
            break
        assert time.monotonic() - hung_up < 2.0, f"checks for clients that left still run: {values}"
        time.sleep(0.05)
    assert values["engine:grammar_checks_cancelled_total"] == cancelled + 20
    with _canaries(server) as seen:
        time.sleep(2.0)
    _assert_canaries_were_served(seen)
    server.wait_idle()


UNSATISFIABLE_GRAMMARS = [
    ("regex", "/v1/completions", {"prompt": "hi", "regex": "[^\\s\\S]", "max_tokens": 3}),
    (
        "response_format",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": _schema_format({"type": "string", "pattern": "[^\\s\\S]"})},
    ),
    ("ebnf", "/v1/completions", {"prompt": "hi", "ebnf": "root ::= [^\\0-\\U0010FFFF]", "stream": True}),
    (
        "structured_outputs",
        "/v1/completions",
        {"prompt": "hi", "structured_outputs": {"grammar": 'root ::= "a" [^\\x00-\\U0010ffff]'}},
    ),
]


@pytest.mark.parametrize("field,path,body", UNSATISFIABLE_GRAMMARS, ids=[f for f, _, _ in UNSATISFIABLE_GRAMMARS])
def test_a_grammar_no_text_can_match_is_a_400_naming_its_field(
    server: ServerProcess, field: str, path: str, body: dict[str, Any]
) -> None:
    """Issue #48: these were a 500 after generation had begun (every token masked), which the OpenAI client
    retries. Now a 400 before anything is queued, streaming too (no 200 and an error event)."""
    with _canaries(server) as seen:
        time.sleep(0.3)
        response = _send_any(server.base_url, "POST", path, body)
        time.sleep(0.5)
    error = assert_openai_error(response, 400)
    assert error["param"] == field and "can never be matched" in error["message"], error
    assert "a character class in it matches no character" in error["message"], error
    _assert_canaries_were_served(seen)
    server.wait_idle()


@pytest.mark.parametrize("limit", ["depth", "size"])
def test_grammar_limits_accept_just_under_and_refuse_just_over_with_the_message(
    server: ServerProcess, limit: str
) -> None:
    """The server's defaults: 64 levels of nesting, 1 MiB of schema text."""
    if limit == "depth":
        under, over = _nested_arrays(64), _nested_arrays(65)
        message = "response_format: the json schema nests 65 levels deep; at most 64 (--grammar-max-depth)"
    else:
        bare = len(json.dumps({"type": "string", "description": ""}))
        under = {"type": "string", "description": "x" * (2**20 - bare)}
        over = {"type": "string", "description": "x" * (2**20 - bare + 1)}
        assert len(json.dumps(under)) == 2**20
        message = "response_format: the json schema has 1,048,577 characters; at most 1,048,576 (--grammar-max-chars)"
    accepted = _send_any(
        server.base_url, "POST", "/v1/completions", {**CANARY, "response_format": _schema_format(under)}
    )
    assert accepted.status_code == 200, accepted.text
    error = assert_openai_error(
        _send_any(server.base_url, "POST", "/v1/completions", {**CANARY, "response_format": _schema_format(over)}), 400
    )
    assert error["message"] == message and error["param"] == "response_format", error
    server.wait_idle()
