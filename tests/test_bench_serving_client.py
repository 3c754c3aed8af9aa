"""`engine bench serving` against the test server: streaming and non-streaming requests, spread over
several HTTP clients (engine/bench_serving.py says why), each counted once with its timeline."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from server_helpers import shared_server

from engine.bench_serving import (
    CONNECTIONS_PER_CLIENT,
    add_bench_serving_args,
    make_workload,
    run_benchmark,
    run_benchmark_processes,
)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_every_request_is_counted_once_over_several_clients(stream: bool) -> None:
    server = shared_server()
    parser = argparse.ArgumentParser()
    add_bench_serving_args(parser)
    concurrency = CONNECTIONS_PER_CLIENT + 2  # two clients
    argv = ["--base-url", server.base_url, "--num-prompts", str(concurrency + 4), "--max-concurrency", str(concurrency)]
    argv += ["--dataset-name", "random", "--vocab-size", "1000", "--input-len", "4,12", "--output-len", "3"]
    args = parser.parse_args(argv + ([] if stream else ["--disable-stream"]))
    summary = asyncio.run(run_benchmark(args))
    assert summary["failed"] == 0, summary["errors"]
    assert summary["completed"] == concurrency + 4 and summary["stream"] is stream
    assert summary["total_output_tokens"] == 3 * (concurrency + 4)
    sent = sorted(r["sent"] for r in summary["requests"])
    assert sent[0] >= 0 and sent[-1] < summary["duration_s"]
    assert 0 < summary["client_cpu_fraction"] < 2
    if not stream:
        assert all(r["ttft"] == r["latency"] for r in summary["requests"])


def test_client_processes_share_the_requests_and_the_concurrency() -> None:
    """Three client processes: every request sent once, by one of them, the run timed from the first start."""
    server = shared_server()
    parser = argparse.ArgumentParser()
    add_bench_serving_args(parser)
    argv = ["--base-url", server.base_url, "--num-prompts", "10", "--max-concurrency", "4", "--client-processes", "3"]
    argv += ["--dataset-name", "random", "--vocab-size", "1000", "--input-len", "4,12", "--output-len", "2"]
    summary = run_benchmark_processes(parser.parse_args(argv))
    assert summary["failed"] == 0, summary["errors"]
    assert summary["client_processes"] == 3 and summary["completed"] == 10
    assert summary["total_output_tokens"] == 20
    assert sorted(r["prompt_words"] for r in summary["requests"]) == sorted(
        len(prompt) for prompt, _ in make_workload(10, "4,12", "2", 0, 1000)
    )
    assert 0 <= summary["client_start_spread_s"] < 2 and summary["duration_s"] > 0
