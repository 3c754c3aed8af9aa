"""A plain request's worst latency while `engine serve` is attacked with grammars (issue #48's attack run).

    PYTHONPATH=. python benchmarks/hostile_grammars.py --output-json bench_results/hostile_grammars.json
    PYTHONPATH=. python benchmarks/hostile_grammars.py --repo /tmp/before --output-json before.json  # old code

Each attack gets a fresh server (the embedded model on the CPU, loopback; the test server's flags), so work one
attack leaves behind cannot slow the next. While it runs, and for --settle seconds after, a canary loop sends one
request at a time: a plain completion of 4 tokens, and, alternately, one with a small JSON schema of its own
(never seen before, so it needs a compile). The table gives each attack's answers and each canary's worst latency.

Attacks: deep900 (a 25 KB schema of arrays nested 900 deep), deep900x3 (three at once), left300x20 (twenty
300-deep schemas whose clients hang up after 0.3 s), wide2000x3 (three schemas of 2,000 properties: within the
size and depth limits, 28 s to compile each), leftwide2000x20 (twenty of those, clients hanging up after 0.3 s),
unsatisfiable (the regex [^\\s\\S], a schema pattern of it, an EBNF
class that excludes every character).
"""

from __future__ import annotations

import argparse
import json
import os
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
CANARY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def wide_object(properties: int, tag: str) -> dict[str, Any]:
    fields = {f"{tag}_{i}": {"type": ["string", "integer", "null"]} for i in range(properties)}
    return {"type": "object", "properties": fields}


def schema_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt": "hi",
        "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


UNSATISFIABLE = [
    {"prompt": "hi", "regex": "[^\\s\\S]", "max_tokens": 3},
    schema_body({"type": "string", "pattern": "[^\\s\\S]"}),
    {"prompt": "hi", "ebnf": "root ::= [^\\0-\\U0010FFFF]", "max_tokens": 3},
]


def post(base: str, body: dict[str, Any], timeout: float) -> tuple[int | str, float, str]:
    """(status or "timeout"/"error", seconds, message of an error)."""
    start = time.monotonic()
    try:
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return "timeout", time.monotonic() - start, ""
    except httpx.HTTPError as exc:
        return "error", time.monotonic() - start, str(exc)
    message = ""
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
    return response.status_code, time.monotonic() - start, message


def hang_up_after(base_port: int, body: dict[str, Any], seconds: float) -> tuple[int | str, float, str]:
    """Send the request on a raw socket and close it after `seconds`, as a client that gives up."""
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", base_port)) as sock:
        sock.sendall(head + payload)
        time.sleep(seconds)
    return "hung up", seconds, ""


def attacks(base: str, port: int, timeout: float) -> dict[str, list[Callable[[], tuple[int | str, float, str]]]]:
    deep900 = schema_body(nested_arrays(900))
    return {
        "deep900": [lambda: post(base, deep900, timeout)],
        "deep900x3": [lambda: post(base, deep900, timeout)] * 3,
        "left300x20": [
            (lambda i=i: hang_up_after(port, {**schema_body(nested_arrays(300 + i))}, 0.3)) for i in range(20)
        ],
        "wide2000x3": [(lambda i=i: post(base, schema_body(wide_object(2000, f"a{i}")), timeout)) for i in range(3)],
        "leftwide2000x20": [
            (lambda i=i: hang_up_after(port, schema_body(wide_object(2000, f"b{i}")), 0.3)) for i in range(20)
        ],
        "unsatisfiable": [(lambda body=body: post(base, body, timeout)) for body in UNSATISFIABLE],
    }


def run_attack(base: str, port: int, name: str, settle: float, timeout: float, canary_timeout: float) -> dict[str, Any]:
    calls = attacks(base, port, timeout)[name]
    results: list[tuple[int | str, float, str]] = []
    plain: list[float] = []
    constrained: list[float] = []
    failures: list[str] = []
    # One schema request before the attack: what is timed below is waiting behind the attack, not the cold start
    # of the grammar machinery (its compiler processes start with the server; the old code prepared the
    # vocabulary on its first compile). Its latency is reported apart.
    warm = schema_body({"type": "object", "properties": {"warm": {"type": "integer"}}})
    _, cold_s, _ = post(base, {**warm, "max_tokens": 4}, canary_timeout)
    threads = [threading.Thread(target=lambda call=call: results.append(call())) for call in calls]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(0.05)  # the attack reaches the server first
    ended: float | None = None
    index = 0
    while ended is None or time.monotonic() < ended + settle:
        small = schema_body({"type": "object", "properties": {f"canary_{index}": {"type": "integer"}}})
        body = CANARY if index % 2 == 0 else {**small, "max_tokens": 4}
        status, seconds, message = post(base, body, canary_timeout)
        (plain if index % 2 == 0 else constrained).append(seconds)
        if status != 200:
            failures.append(f"{status} {message[:80]}")
        index += 1
        if ended is None and not any(thread.is_alive() for thread in threads):
            ended = time.monotonic()
    for thread in threads:
        thread.join()
    return {
        "attack": name,
        "attack_s": (ended or time.monotonic()) - start,
        "answers": sorted({f"{status} {message[:70]}".strip() for status, _, message in results}),
        "plain_canaries": len(plain),
        "plain_worst_s": max(plain),
        "plain_median_s": statistics.median(plain),
        "schema_canaries": len(constrained),
        "schema_worst_s": max(constrained) if constrained else None,
        "schema_median_s": statistics.median(constrained) if constrained else None,
        "schema_cold_s": cold_s,
        "canary_failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=os.getcwd(), help="checkout whose `engine serve` is attacked")
    parser.add_argument("--server-args", default=SERVER_ARGS, help="flags of `engine serve`")
    parser.add_argument(
        "--attacks",
        default="deep900,deep900x3,left300x20,wide2000x3,leftwide2000x20,unsatisfiable",
        help="comma-separated",
    )
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of canaries after the attack ends")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds an attack request may take")
    parser.add_argument("--canary-timeout", type=float, default=60.0, help="seconds before a canary gives up")
    parser.add_argument("--output-json", default="bench_results/hostile_grammars.json")
    args = parser.parse_args()
    rows = []
    for name in args.attacks.split(","):
        log_path = os.path.join(os.path.dirname(os.path.abspath(args.output_json)), f"hostile_grammars_{name}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        server = Server(os.path.abspath(args.repo), shlex.split(args.server_args), log_path)
        try:
            post(server.base, CANARY, args.canary_timeout)  # warm
            row = run_attack(server.base, server.port, name, args.settle, args.timeout, args.canary_timeout)
        finally:
            server.stop()
        rows.append(row)
        print(
            f"{name:>14}  attack {row['attack_s']:6.1f} s  plain canary worst {row['plain_worst_s']:6.2f} s "
            f"(median {row['plain_median_s']:.2f}, n={row['plain_canaries']})  schema canary worst "
            f"{row['schema_worst_s'] or 0:6.2f} s (median {row['schema_median_s'] or 0:.2f}, "
            f"n={row['schema_canaries']}; before the attack {row['schema_cold_s']:.2f} s)  answers {row['answers']}"
            + (f"  canary failures {row['canary_failures']}" if row["canary_failures"] else ""),
            flush=True,
        )
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump({"repo": os.path.abspath(args.repo), "server_args": args.server_args, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
