"""`engine serve --data-parallel-size 2 --distributed-executor-backend ray` on a local Ray cluster of two
nodes (two raylets on loopback, a CPU each): one replica per node, answers as one engine gives, a replica
whose actor dies fails only its requests and comes back, and the server stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import REPO_ROOT
from server_helpers import MODEL, ServerProcess, shared_server, start_server

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    from ray.cluster_utils import Cluster

    # Ray's workers import the engine: from this checkout, whatever is installed.
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, path) if p)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    try:
        yield nodes.address
    finally:
        nodes.shutdown()
        os.environ["PYTHONPATH"] = path


@pytest.fixture(scope="module")
def server(cluster: str) -> Iterator[ServerProcess]:
    os.environ["RAY_ADDRESS"] = cluster
    try:
        process = start_server(
            "--data-parallel-size", "2", "--distributed-executor-backend", "ray", "--router-policy", "round_robin",
            log_name="server-ray",
        )  # fmt: skip
    finally:
        del os.environ["RAY_ADDRESS"]
    yield process
    process.stop()


def _complete(server: ServerProcess, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_replica_on_each_node_answers_as_one_engine_does(server: ServerProcess) -> None:
    nodes = re.findall(r"(engine \d) ready on Ray node (\w+)", server.log())
    assert len(nodes) == 2 and nodes[0][1] != nodes[1][1], nodes  # spread over the two nodes
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "Once upon a time"]
    assert [_complete(server, p) for p in prompts] == [_complete(shared_server(), p) for p in prompts]


def test_a_dead_actor_fails_its_requests_only_and_its_replica_comes_back(server: ServerProcess) -> None:
    ready = re.findall(r"(engine \d) ready on Ray node \w+ \(pid (\d+)\)", server.log())
    pids = {name: int(pid) for name, pid in ready}
    body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}
    streams: dict[int, list[str]] = {0: [], 1: []}

    def stream(index: int) -> None:
        url = f"{server.base_url}/v1/completions"
        with httpx.stream("POST", url, json={**body, "prompt": f"Story {index}:"}, timeout=120) as response:
            streams[index].extend(line for line in response.iter_lines() if line.startswith("data: "))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # round robin: one on each
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    deadline = time.monotonic() + 60
    while min(len(lines) for lines in streams.values()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(pids["engine 0"], signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    failed = [lines for lines in streams.values() if any('"error"' in line for line in lines)]
    assert len(failed) == 1, {k: v[-2:] for k, v in streams.items()}
    assert "engine 0" in next(line for line in failed[0] if '"error"' in line)
    finished = [lines for lines in streams.values() if lines not in failed]
    assert finished[0][-1] == "data: [DONE]" and '"finish_reason": "length"' in finished[0][-2]
    deadline = time.monotonic() + 120
    while "engine 0 is back" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "engine 0 is back" in server.log(), server.log()[-3000:]
    assert [_complete(server, f"Count: {i},") for i in range(4)]  # both replicas serve again


def test_the_server_stops_cleanly(server: ServerProcess) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.log()[-3000:]
    log = server.log()
    assert "engine 0 stopped" in log and "engine 1 stopped" in log and "Traceback" not in log, log[-3000:]
