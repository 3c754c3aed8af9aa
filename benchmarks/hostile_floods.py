"""A 3-token canary's worst latency while `engine serve` is flooded (issue #48, items 2 and 3).

    PYTHONPATH=. python benchmarks/hostile_floods.py --output-json bench_results/hostile_floods.json
    PYTHONPATH=. python benchmarks/hostile_floods.py --repo /tmp/before --output-json before.json  # old code

Each attack gets a fresh server (the embedded model on the CPU, loopback; the test server's flags). The attack
starts, and --delay seconds later a canary loop sends one 3-token completion at a time (every 0.5 s at most) for
--window seconds; then the attack's clients hang up (the server aborts what they left). The table gives each
canary's worst and median latency, and /health's worst latency while the attack ran.

Greedy requests (item 2): n128 (`n: 128, max_tokens: 300, ignore_eos`), six1900 (six 1,900-token prompts in one
request), echo (a 1,900-token prompt with echo and 20 prompt logprobs), echo_n8 (the same with n=8).
Floods (item 3): bodies8mb (eight concurrent 8.2 MB token-id bodies), idle1100 and idle10000 (that many idle
sockets held open while the canaries run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from benchmarks.serve_process import Server

SERVER_ARGS = "--dtype float32 --capture-sizes 1,2,4,8 --max-num-seqs 8 --kv-cache-tokens 8192 --torch-threads 1"
CANARY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
LONG_PROMPT = "word " * 1890  # 1,891 tokens for SmolLM2's tokenizer


def raw_request(port: int, body: bytes, stop: threading.Event) -> str:
    """POST the body on a raw socket; read until the answer is complete or `stop` is set (then hang up)."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        sock.settimeout(0.2)
        received = b""
        while not stop.is_set():
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            received += chunk
    return received.split(b"\r\n", 1)[0].decode(errors="replace") or "hung up"


def token_id_body(size: int) -> bytes:
    """A token-id prompt of about `size` bytes (ids 1000-9999, five bytes each with the comma)."""
    count = size // 5
    return json.dumps(
        {"prompt": [1000 + i % 9000 for i in range(count)], "max_tokens": 1}, separators=(",", ":")
    ).encode()


def attack_calls(port: int, stop: threading.Event) -> dict[str, list[Callable[[], str]]]:
    def send(body: dict[str, Any] | bytes) -> Callable[[], str]:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        return lambda: raw_request(port, payload, stop)

    echo = {"prompt": LONG_PROMPT, "max_tokens": 1, "echo": True, "logprobs": 20}
    big = token_id_body(8_200_000)
    return {
        "n128": [send({"prompt": "Tell me a story:", "n": 128, "max_tokens": 300, "ignore_eos": True})],
        "six1900": [send({"prompt": [LONG_PROMPT] * 6, "max_tokens": 16, "ignore_eos": True})],
        "echo": [send(echo)],
        "echo_n8": [send({**echo, "n": 8})],
        "bodies8mb": [send(big)] * 8,
        "idle1100": [lambda: hold_idle(port, 1100, stop)],
        "idle10000": [lambda: hold_idle(port, 10000, stop)],
    }


def hold_idle(port: int, count: int, stop: threading.Event) -> str:
    """Open `count` connections that send nothing, hold them until `stop`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 512), hard))
    sockets = []
    try:
        for _ in range(count):
            try:
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        opened = len(sockets)
        stop.wait()
    finally:
        for sock in sockets:
            sock.close()
    return f"{opened} opened"


def timed(call: Callable[[], httpx.Response]) -> tuple[int | str, float]:
    start = time.monotonic()
    try:
        status: int | str = call().status_code
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return status, time.monotonic() - start


def run_attack(server: Server, name: str, delay: float, window: float, canary_timeout: float) -> dict[str, Any]:
    stop = threading.Event()
    calls = attack_calls(server.port, stop)[name]
    answers: list[str] = []
    threads = [threading.Thread(target=lambda call=call: answers.append(call())) for call in calls]
    health: list[float] = []
    health_stop = threading.Event()

    def probe_health() -> None:
        while not health_stop.is_set():
            health.append(timed(lambda: httpx.get(f"{server.base}/health", timeout=canary_timeout))[1])
            time.sleep(0.05)

    prober = threading.Thread(target=probe_health)
    start = time.monotonic()
    for thread in threads:
        thread.start()
    prober.start()
    time.sleep(delay)
    canaries: list[tuple[int | str, float]] = []
    with httpx.Client(timeout=canary_timeout) as client:
        while time.monotonic() < start + delay + window:
            sent = time.monotonic()
            canaries.append(timed(lambda: client.post(f"{server.base}/v1/completions", json=CANARY)))
            time.sleep(max(0.0, 0.5 - (time.monotonic() - sent)))
    stop.set()
    for thread in threads:
        thread.join(60)
    health_stop.set()
    prober.join(60)
    seconds = [s for _, s in canaries]
    return {
        "attack": name,
        "answers": sorted(set(answers)),
        "canaries": len(canaries),
        "canary_failures": [status for status, _ in canaries if status != 200],
        "canary_worst_s": max(seconds),
        "canary_median_s": statistics.median(seconds),
        "health_worst_s": max(health) if health else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=os.getcwd(), help="checkout whose `engine serve` is attacked")
    parser.add_argument("--server-args", default=SERVER_ARGS, help="flags of `engine serve`")
    parser.add_argument("--attacks", default="n128,six1900,echo,echo_n8", help="comma-separated")
    parser.add_argument("--delay", type=float, default=3.0, help="seconds between the attack and the first canary")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of canaries")
    parser.add_argument("--canary-timeout", type=float, default=120.0, help="seconds before a canary gives up")
    parser.add_argument("--output-json", default="bench_results/hostile_floods.json")
    args = parser.parse_args()
    rows = []
    for name in args.attacks.split(","):
        log_path = os.path.join(os.path.dirname(os.path.abspath(args.output_json)), f"hostile_floods_{name}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        server = Server(os.path.abspath(args.repo), shlex.split(args.server_args), log_path)
        try:
            httpx.post(f"{server.base}/v1/completions", json=CANARY, timeout=args.canary_timeout)  # warm
            row = run_attack(server, name, args.delay, args.window, args.canary_timeout)
        finally:
            server.stop()
        rows.append(row)
        print(
            f"{name:>10}  canary worst {row['canary_worst_s']:6.2f} s (median {row['canary_median_s']:.2f}, "
            f"n={row['canaries']})  /health worst {row['health_worst_s'] or 0:6.2f} s  answers {row['answers']}"
            + (f"  canary failures {row['canary_failures']}" if row["canary_failures"] else ""),
            flush=True,
        )
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump({"repo": os.path.abspath(args.repo), "server_args": args.server_args, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
