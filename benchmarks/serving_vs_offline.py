"""The server against the engine in-process, on the same requests: how much serving costs.

    PYTHONPATH=. python benchmarks/serving_vs_offline.py --concurrencies 64,256 --num-prompts 512 \
        --input-len 512 --output-len 256 --engine-args "--device cuda --model llama-3-8b --load-format dummy" \
        --output-json bench_results/serving_vs_offline.json

1. Starts `engine serve` with --engine-args, runs `engine bench serving --dataset-name random` (streaming
   /v1/completions of random token-id prompts, ignore_eos) at each concurrency, stops the server.
2. Builds the same engine in this process and runs the very same requests, at most `concurrency`
   at a time (a new one starts when one finishes, as the clients do).
Prints a table and writes JSON: output tok/s of both, their ratio, and the server's TTFT and ITL.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from typing import Any

import httpx
import torch

from benchmarks.serve_process import wait_for_health
from engine.bench_serving import add_bench_serving_args, make_workload, run_benchmark_processes
from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def serve_and_bench(
    engine_args: list[str],
    concurrencies: list[int],
    bench: argparse.Namespace,
    port: int,
    ready_timeout: float,
    profile_to: str | None = None,
) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        *engine_args,
        "--port",
        str(port),
        "--max-pending-requests",
        str(max(1024, bench.num_prompts)),
    ]
    if profile_to:
        # py-spy as the server's parent (no ptrace rights needed beyond a parent's): every thread of the
        # server and of its engine process, as collapsed stacks ("process;thread;frames count").
        profiler = ["py-spy", "record", "--subprocesses", "--threads", "--nonblocking", "-r", "50", "--format", "raw"]
        command = [*profiler, "-o", profile_to, "--", *command]
    print("starting:", shlex.join(command), flush=True)
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    # A session of its own, so that one SIGINT to its group stops the server and a profiler around it.
    cores = _cpu_list(bench.engine_cpus)
    server = subprocess.Popen(
        command,
        env={**os.environ, "PYTHONPATH": path},
        start_new_session=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    url = f"http://127.0.0.1:{port}"
    seed = bench.seed
    try:
        wait_for_health(url, server, ready_timeout)
        results = []
        for run, (concurrency, stream) in enumerate(itertools.product(concurrencies, bench.stream_modes)):
            bench.base_url, bench.max_concurrency, bench.disable_stream = url, concurrency, not stream
            # Prompts of their own for each run: none finds the last run's pages in the prefix cache.
            bench.seed = seed + run
            before = _server_ttft_histogram(url)
            summary = run_benchmark_processes(bench)
            # The server's own time to first token (handler registered -> first output routed), beside the
            # client's: what the client sees on top of it is the HTTP round trip and the event loop's delay.
            summary["server_side_ttft_s"] = _histogram_median(before, _server_ttft_histogram(url))
            # The timeline (when each request went out, its first token, how long it took), to find stalls.
            summary["timeline"] = [
                (round(r["sent"], 4), round(r["ttft"], 4), round(r["latency"], 4)) for r in summary.pop("requests")
            ]
            print(
                f"server, concurrency {concurrency}, {'streaming' if stream else 'non-streaming'}: "
                f"{summary['output_throughput']:.0f} output tok/s, client CPU/wall "
                f"{summary['client_cpu_fraction']:.2f}, {summary['completed']} completed, "
                f"{summary['failed']} failed {summary['errors']}",
                flush=True,
            )
            results.append(summary)
        bench.seed = seed
        return results
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _server_ttft_histogram(url: str) -> dict[float, float]:
    """The server's engine:time_to_first_token_seconds buckets (upper bound -> cumulative count)."""
    buckets: dict[float, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("engine:time_to_first_token_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = buckets.get(float(bound), 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


def _histogram_median(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The median of the observations between two scrapes, interpolated within its bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    half, lower, below = counts[-1] / 2, 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= half:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (half - below) / max(cumulative - below, 1e-9)
        lower, below = bound, cumulative
    return None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def _cpu_list(text: str | None) -> set[int]:
    """'0,2-3' -> {0, 2, 3}; None or '' -> empty (no pinning)."""
    cores: set[int] = set()
    for part in (text or "").split(","):
        if part.strip():
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    return cores


def offline(engine: Engine, workload: list[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    """The same requests in-process, at most `concurrency` at once; time to first token from each add."""
    queue = deque(workload)
    live = generated = 0
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    timeline: list[tuple[float, float, float]] = []  # as the server's: sent, time to first token, latency
    steps: list[tuple[float, float, int, int]] = []  # each engine.step(): start, ms, outputs, first tokens

    def submit() -> None:
        prompt, max_tokens = queue.popleft()
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        added[request_id] = time.perf_counter()

    engine.platform.synchronize()
    start = time.perf_counter()
    while queue and live < concurrency:
        submit()
        live += 1
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_end = time.perf_counter()
        firsts = 0
        for output in outputs:
            generated += len(output.new_token_ids)
            now = time.perf_counter()
            if output.request_id not in first and output.new_token_ids:
                first[output.request_id] = now
                firsts += 1
            if output.finished:
                sent = added.pop(output.request_id)
                ttft = first.pop(output.request_id, now) - sent
                timeline.append((round(sent - start, 4), round(ttft, 4), round(now - sent, 4)))
                live -= 1
                if queue:
                    submit()
                    live += 1
        steps.append((round(step_start - start, 4), round(1e3 * (step_end - step_start), 2), len(outputs), firsts))
    engine.platform.synchronize()
    wall = time.perf_counter() - start
    ttfts = sorted(entry[1] for entry in timeline)
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "output_tokens": generated,
        "output_throughput": generated / wall,
        "ttft_s": {"median": statistics.median(ttfts), "p99": ttfts[int(0.99 * (len(ttfts) - 1))]},
        "timeline": timeline,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine-args", default="", help="engine flags, for the server and the in-process engine alike"
    )
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--skip-server", action="store_true", help="only the in-process figures")
    parser.add_argument(
        "--engine-cpus",
        default=None,
        help="cores for the server and for the in-process engine alike, e.g. 0 (the client takes --client-cpus): "
        "on a small host both engines then get the same cores, and the client none of theirs",
    )
    parser.add_argument("--client-cpus", default=None, help="cores for the benchmark client while the server runs")
    parser.add_argument(
        "--server-variants",
        default="",
        help="';'-separated sets of server-only flags, one server run each (e.g. "
        "'--engine-process;--no-engine-process'); default: one run with the defaults",
    )
    add_bench_serving_args(parser)
    parser.set_defaults(
        max_concurrency=None,  # --concurrencies instead: one run each
        num_prompts=512,
        input_len="512",
        output_len="256",
        dataset_name="random",
        output_json="bench_results/serving_vs_offline.json",
    )
    parser.add_argument("--concurrencies", default="64,256", help="comma list of concurrencies")
    parser.add_argument(
        "--modes", default="stream", help="comma list of stream (SSE) and whole (non-streaming): one run each"
    )
    parser.add_argument(
        "--profile-server", default=None, help="record the server's processes with py-spy into this file"
    )
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    modes = args.modes.split(",")
    if not set(modes) <= {"stream", "whole"}:
        parser.error(f"--modes takes stream and whole, got {args.modes}")
    args.stream_modes = [mode == "stream" for mode in modes]
    engine_args = shlex.split(args.engine_args)
    report: dict[str, Any] = {
        "engine_args": engine_args,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "modes": modes,
    }
    client_cores, engine_cores = _cpu_list(args.client_cpus), _cpu_list(args.engine_cpus)
    if client_cores:
        os.sched_setaffinity(0, client_cores)
    variants = [shlex.split(v) for v in args.server_variants.split(";")] if args.server_variants else [[]]
    report["servers"] = (
        []
        if args.skip_server
        else [
            {
                "server_args": extra,
                "results": serve_and_bench(
                    engine_args + extra, concurrencies, args, args.port, args.ready_timeout, args.profile_server
                ),
            }
            for extra in variants
        ]
    )
    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    if engine_cores:
        os.sched_setaffinity(0, engine_cores)
        torch.set_num_threads(len(engine_cores))
    in_process_args = engine_parser.parse_args(engine_args)
    # As `engine serve` builds its engine (one for the process's life): start-up's objects frozen out of the
    # garbage collector's scans unless the flags say otherwise (engine/gc_freeze.py).
    engine = Engine(engine_config_from_args(in_process_args, freeze_gc=in_process_args.freeze_gc is not False))
    report["offline"] = []
    for index, concurrency in enumerate(concurrencies):
        seed = args.seed + index * len(modes)  # the prompts of this concurrency's first server run
        workload = make_workload(args.num_prompts, args.input_len, args.output_len, seed, args.vocab_size)
        report["offline"].append(offline(engine, workload, concurrency))  # type: ignore[arg-type]
    print(
        f"{'server flags':>22} {'concurrency':>11} {'mode':>6} {'server tok/s':>13} {'in-process tok/s':>17} "
        f"{'ratio':>6} {'TTFT p50/p99 ms':>16} {'in-process TTFT':>16} {'server-side TTFT p50':>20} "
        f"{'ITL p50/p99 ms':>15} "
        f"{'client CPU':>10}"
    )
    for index, concurrency in enumerate(concurrencies):
        local = report["offline"][index]["output_throughput"]
        lt = report["offline"][index]["ttft_s"]
        if not report["servers"]:
            print(f"{'-':>22} {concurrency:>11} {'-':>6} {'-':>13} {local:>17.0f}")
        for variant in report["servers"]:
            for m, mode in enumerate(modes):
                s = variant["results"][index * len(modes) + m]
                ratio = s["output_throughput"] / local
                s["ratio_to_in_process"] = ratio
                print(
                    f"{' '.join(variant['server_args']) or 'defaults':>22} {concurrency:>11} {mode:>6} "
                    f"{s['output_throughput']:>13.0f} {local:>17.0f} {ratio:>6.2f} "
                    f"{1e3 * s['ttft_s']['median']:>7.0f}/{1e3 * s['ttft_s']['p99']:<8.0f} "
                    f"{1e3 * lt['median']:>7.0f}/{1e3 * lt['p99']:<8.0f} "
                    f"{_ms(s.get('server_side_ttft_s')):>20} "
                    f"{1e3 * s['itl_s']['median']:>6.1f}/{1e3 * s['itl_s']['p99']:<8.1f} "
                    f"{s['client_cpu_fraction']:>10.2f}"
                )
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
