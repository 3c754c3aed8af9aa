"""`engine serve --data-parallel-size 2` on the CPU: two engine processes (a core each) behind one endpoint.

The replicas answer as one engine does; the cache-aware router sends prompts that share a prefix to the
replica that holds it (a higher prefix-cache hit rate than round-robin, on the same requests); a replica
that dies fails only its own requests, leaves the endpoint healthy, and comes back.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_helpers import MODEL, ServerProcess, shared_server, start_server

DOCUMENTS = [
    "Background for the questions below. " + sentence * 10
    for sentence in (
        "The river runs past the old mill and under the stone bridge. ",
        "Trains leave the northern station every hour on the hour. ",
        "The garden has roses, tulips and a small pond with fish. ",
    )
]
QUESTIONS = ["Question: what is it about?", "Question: summarise it.", "Question: name one detail.", "Question: why?"]


def _samples(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by its name and labels (the replicas' series differ by label only)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            labels = re.sub(r'model_name="[^"]*",?', "", match.group(2) or "").strip("{},")
            samples[match.group(1) + (f"{{{labels}}}" if labels else "")] = float(match.group(3))
    return samples


@pytest.fixture(scope="module")
def replicas() -> Iterator[ServerProcess]:
    server = start_server("--data-parallel-size", "2", log_name="server-dp")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def round_robin() -> Iterator[ServerProcess]:
    """Replicas taken in turn: two requests in a row land on different replicas, whatever came before."""
    server = start_server("--data-parallel-size", "2", "--router-policy", "round_robin", log_name="server-dp-rr")
    yield server
    server.stop()


def _complete(server: ServerProcess, prompt: str, max_tokens: int = 6) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _hit_rate(server: ServerProcess) -> tuple[float, dict[str, float]]:
    """Send every question after its document, the documents interleaved; the prefix-cache hit rate of them."""
    before = _samples(server)
    for question in QUESTIONS:
        for document in DOCUMENTS:
            _complete(server, f"{document}\n{question}", max_tokens=2)
    after = _samples(server)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    return hits / queries, after


def test_two_replicas_answer_as_one_engine_does(replicas: ServerProcess) -> None:
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "Once upon a time"]
    one = shared_server()
    assert [_complete(replicas, p) for p in prompts] == [_complete(one, p) for p in prompts]
    # A client that hangs up mid-stream: its replica lets go of the request (the load the router reads).
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{replicas.base_url}/v1/completions", json=body, timeout=60) as response:
        for index, _ in enumerate(response.iter_lines()):
            if index == 3:
                break
    deadline = time.monotonic() + 10
    while any(_samples(replicas)[f'engine:replica_requests{{replica="{r}"}}'] for r in "01"):
        assert time.monotonic() < deadline, _samples(replicas)
        time.sleep(0.1)
    samples = _samples(replicas)
    assert samples['engine:replica_up{replica="0"}'] == samples['engine:replica_up{replica="1"}'] == 1
    assert "2 engine replicas ready" in replicas.log()


def test_the_cache_aware_router_beats_round_robin_on_shared_prefixes(
    replicas: ServerProcess, round_robin: ServerProcess
) -> None:
    cache_aware, samples = _hit_rate(replicas)
    round_robin_rate, _ = _hit_rate(round_robin)
    print(f"hit rate, 3 documents x 4 questions: cache_aware {cache_aware:.3f}, round robin {round_robin_rate:.3f}")
    assert cache_aware > round_robin_rate + 0.1
    assert samples['engine:router_decisions_total{reason="cache"}'] >= 9  # every question after the first


def test_a_replica_that_dies_fails_only_its_requests_and_comes_back(round_robin: ServerProcess) -> None:
    replicas = round_robin
    pids = {name: int(pid) for pid, name in re.findall(r"engine process (\d+) started \((engine \d)\)", replicas.log())}
    body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    streams: dict[str, list[str]] = {}

    def stream(name: str, prompt: str) -> None:
        lines = streams.setdefault(name, [])
        with httpx.stream(
            "POST", f"{replicas.base_url}/v1/completions", json={**body, "prompt": prompt}, timeout=120
        ) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    # Two requests in a row: one on each replica.
    threads = [threading.Thread(target=stream, args=(str(i), f"A new story number {i}:")) for i in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while sum(len(lines) > 3 for lines in streams.values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(pids["engine 0"], signal.SIGKILL)
    killed = time.monotonic()
    while _samples(replicas)['engine:replica_up{replica="0"}'] != 0:
        assert time.monotonic() - killed < 1.0, "the router did not mark the dead replica down within a second"
        time.sleep(0.02)
    for thread in threads:
        thread.join(120)
    errors = [lines for lines in streams.values() if any('"error"' in line for line in lines)]
    finished = [
        lines for lines in streams.values() if lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)
    ]
    assert len(errors) == 1 and len(finished) == 1, {k: v[-2:] for k, v in streams.items()}
    assert "engine 0" in next(line for line in errors[0] if '"error"' in line)
    last = json.loads(finished[0][-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    # The endpoint stays up on the other replica, and the dead one comes back.
    assert httpx.get(f"{replicas.base_url}/health", timeout=10).status_code == 200
    assert _complete(replicas, "The capital of France is")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _samples(replicas).get('engine:replica_restarts_total{replica="0"}', 0) < 1:
        time.sleep(0.5)
    samples = _samples(replicas)
    assert samples['engine:replica_up{replica="0"}'] == 1 and samples['engine:replica_restarts_total{replica="0"}'] == 1
    assert "engine 0 is back" in replicas.log()
    assert [_complete(replicas, f"Count: {i},") for i in range(4)]


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--data-parallel-size", "0"], ["--data-parallel-size must be >= 1"]),
        (["--data-parallel-size", "64"], ["--data-parallel-size 64 needs a core per replica"]),
        (["--data-parallel-size", "2", "--no-engine-process"], ["process of its own"]),
        (["--data-parallel-size", "2", "--router-cache-threshold", "2"], ["cache threshold"]),
    ],
)
def test_replica_flags_that_cannot_work_are_one_error_line(flags: list[str], needles: list[str]) -> None:
    from test_errors import assert_cli_error, run_cli

    assert_cli_error(run_cli("serve", "--device", "cpu", "--port", "0", *flags), *needles)


def test_replicas_of_two_tensor_parallel_ranks_each_answer_as_one_engine_does(tiny_llama: str) -> None:
    """--data-parallel-size 2 --tensor-parallel-size 2: each replica's engine process spawns its second rank
    (a daemon's child: the engine process lifts the flag for that), and a tiny Llama answers with the greedy
    ids of one engine in-process."""
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    prompts = [[5, 17, 99, 23], [200, 3, 77, 77, 12], [9, 8, 7, 6]]
    local = Engine(model=tiny_llama, device="cpu", dtype="float32", disable_graphs=True)
    want = [
        o.token_ids for o in local.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ]
    local.shutdown()
    server = start_server(
        "--model",
        tiny_llama,
        "--disable-graphs",
        "--data-parallel-size",
        "2",
        "--tensor-parallel-size",
        "2",
        log_name="server-dp-tp",
    )
    try:
        got = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["token_ids"])
        assert got == want
        assert server.log().count("tensor parallelism: 2 ranks ready") == 2
    finally:
        server.stop()


def test_tensor_parallel_replicas_take_consecutive_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device split for --data-parallel-size x --tensor-parallel-size on CUDA (no GPU needed to plan it)."""
    from backends.cuda.platform import CudaPlatform
    from engine.server.replicas import placements

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    shares = placements(CudaPlatform(), 2, None, devices_per_replica=4)
    assert [(s.visible_devices, s.visible_devices_env) for s in shares] == [
        ("0,1,2,3", "CUDA_VISIBLE_DEVICES"),
        ("4,5,6,7", "CUDA_VISIBLE_DEVICES"),
    ]
    assert [s.visible_devices for s in placements(CudaPlatform(), 8, None)] == [str(i) for i in range(8)]
    with pytest.raises(ValueError, match="needs 12 devices; 8 are visible"):
        placements(CudaPlatform(), 3, None, devices_per_replica=4)


def test_a_ray_replica_runs_its_tensor_parallel_ranks(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--distributed-executor-backend ray --tensor-parallel-size 2 on a local Ray instance: the replica's
    actor spawns its second rank beside itself, and the tiny Llama answers as one engine in-process does."""
    # Ray kills actors when the node's memory passes 95%; the suite's other workers share this machine.
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    prompt = [5, 17, 99, 23]
    local = Engine(model=tiny_llama, device="cpu", dtype="float32", disable_graphs=True)
    want = local.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    local.shutdown()
    server = start_server(
        "--model",
        tiny_llama,
        "--disable-graphs",
        "--distributed-executor-backend",
        "ray",
        "--tensor-parallel-size",
        "2",
        log_name="server-ray-tp",
    )
    try:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == want
        assert "ready on Ray node" in server.log()
    finally:
        server.stop()
