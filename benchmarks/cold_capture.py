"""Cold-cache graph capture, where its time goes: each run a fresh process with empty inductor and Triton caches.

    PYTHONPATH=. python benchmarks/cold_capture.py --model llama-3-8b --load-format dummy --runs 3 \
        [--extend-capture-tokens 16,32,64,128,256,512] --output docs/results/h200_cold_capture.json
    PYTHONPATH=. python benchmarks/cold_capture.py --device cpu --runs 2   # the embedded SmolLM2, CPU graphs

A run builds the engine (KV pool of --kv-cache-tokens) and reports: the decode capture's seconds
(`DecodeGraphRunner.capture`, timed around the call) and graph memory, the extend graphs' capture
(`ExtendGraphRunner.capture`) and memory, both together, the engine build and the whole process, how many
modules the captures imported, dynamo/inductor's own timing table (every entry over 50 ms), and what the main thread was
doing during the capture: its innermost Python frame and its innermost 14 frames sampled every 5 ms (a sampler
thread, so it sees the main thread only when it can take the GIL), and when inductor's compile workers answered
their first job (before that, inductor compiles its kernels on the main thread). The process's log (extend
graphs, the warm-up request's extend step) is kept in the JSON too. Prints a table and writes JSON.

--drop-page-cache stands in for the first process on a fresh machine: before each run it asks the kernel to
drop the page cache of every file under Python's, torch's and the CUDA driver's directories
(posix_fadvise DONTNEED; no root needed), so the run reads its modules and libraries from disk again.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any

SAMPLE_S = 0.005
STACK_DEPTH = 14


def _profile_one_run(args: argparse.Namespace) -> dict[str, Any]:
    """In the child process: build the engine once, timing and sampling its decode capture."""
    import logging

    started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f %(name)s: %(message)s")
    import graphs.step_runner
    from engine.config import EngineConfig
    from engine.engine import Engine

    frames: collections.Counter = collections.Counter()
    stacks: collections.Counter = collections.Counter()
    pool: dict[str, Any] = {}
    main_thread, sampling, done = threading.get_ident(), threading.Event(), threading.Event()

    def sample() -> None:
        while not done.is_set():
            time.sleep(SAMPLE_S)
            _note_pool_ready(pool, started)
            frame = sys._current_frames().get(main_thread) if sampling.is_set() else None
            if frame is not None:
                frames[_frame_name(frame)] += 1
                stacks[_stack(frame)] += 1

    threading.Thread(target=sample, daemon=True).start()
    spans: dict[str, float] = {"decode_capture_s": 0.0, "extend_capture_s": 0.0}
    imported: list[str] = []

    def timed(span: str, capture: Any) -> Any:
        def timed_capture(runner: Any, *args: Any, **kwargs: Any) -> None:
            sampling.set()
            pool.setdefault("ready_at_first_capture", bool(pool.get("ready_after_s")))
            modules = set(sys.modules)
            began = time.perf_counter()
            try:
                capture(runner, *args, **kwargs)
            finally:
                spans[span] = time.perf_counter() - began
                sampling.clear()
                imported.extend(sorted(set(sys.modules) - modules))

        return timed_capture

    from graphs.extend_graph_runner import ExtendGraphRunner

    decode_graphs = graphs.step_runner.DecodeGraphRunner
    decode_graphs.capture = timed("decode_capture_s", decode_graphs.capture)
    ExtendGraphRunner.capture = timed("extend_capture_s", ExtendGraphRunner.capture)
    options: dict[str, Any] = {}
    if args.extend_capture_tokens:
        options["extend_capture_tokens"] = args.extend_capture_tokens
    began = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            load_format=args.load_format,
            kv_cache_tokens=args.kv_cache_tokens,
            **options,
        )
    )
    spans["engine_build_s"] = time.perf_counter() - began
    spans["all_captures_s"] = spans["decode_capture_s"] + spans["extend_capture_s"]
    spans["process_s"] = time.perf_counter() - started
    done.set()
    from torch._dynamo.utils import compilation_time_metrics

    graphs = engine.runner.graph_runner
    extend_graphs = engine.runner.extend_graphs
    return {
        "spans": spans,
        "decode_graph_memory_mib": graphs.graph_memory_bytes / 2**20 if graphs is not None else None,
        "extend_graph_memory_mib": extend_graphs.graph_memory_bytes / 2**20 if extend_graphs is not None else None,
        "compile_times_s": {
            name: round(sum(values), 3) for name, values in compilation_time_metrics.items() if sum(values) > 0.05
        },
        "modules_imported_in_captures": len(imported),
        "packages_imported_in_captures": dict(
            collections.Counter(".".join(name.split(".")[:3]) for name in imported).most_common(15)
        ),
        "main_thread_frames_s": {name: round(count * SAMPLE_S, 2) for name, count in frames.most_common(20)},
        "main_thread_stacks_s": {name: round(count * SAMPLE_S, 2) for name, count in stacks.most_common(40)},
        "inductor_pool": pool,
        "inductor_counters": _inductor_counters(),
    }


def _frame_name(frame: Any) -> str:
    return f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_code.co_name}"


def _stack(frame: Any, depth: int = STACK_DEPTH) -> str:
    """The innermost `depth` frames of a stack, outermost first, ';'-joined (flame-graph order)."""
    names = []
    while frame is not None and len(names) < depth:
        names.append(_frame_name(frame))
        frame = frame.f_back
    return ";".join(reversed(names))


def _note_pool_ready(pool: dict[str, Any], started: float) -> None:
    """When inductor's compile workers answered their first job (backends.cuda.platform.inductor_pool_ready):
    until then inductor compiles its Triton kernels one by one on the main thread (`async_compile.precompile`
    in the timing table)."""
    if "ready_after_s" in pool or "torch._inductor.async_compile" not in sys.modules:
        return
    from torch._inductor import config

    from backends.cuda.platform import inductor_pool_ready

    pool.setdefault("compile_threads", config.compile_threads)
    pool.setdefault("worker_start_method", config.worker_start_method)
    if inductor_pool_ready():
        pool["ready_after_s"] = round(time.perf_counter() - started, 2)


def _inductor_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(value) for name, value in counters["inductor"].items() if "compile" in name}


def _library_dirs() -> list[str]:
    """Where the child's modules and libraries come from: Python's own, its site-packages, PYTHONPATH, the driver."""
    dirs = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path and path != "."}
    return sorted(dirs)


def drop_page_cache() -> int:
    """Drop the page cache of every file under _library_dirs() and the CUDA driver's libraries; returns how many."""
    paths = [os.path.join(root, name) for top in _library_dirs() for root, _, names in os.walk(top) for name in names]
    paths += glob.glob("/usr/lib/x86_64-linux-gnu/libcuda*") + glob.glob("/usr/lib/x86_64-linux-gnu/libnvidia*")
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return dropped


def _run_fresh(args: argparse.Namespace, index: int) -> dict[str, Any]:
    """One run in a child process with empty cache directories of its own."""
    dropped = drop_page_cache() if args.drop_page_cache else 0
    with (
        tempfile.TemporaryDirectory(prefix="inductor-") as inductor,
        tempfile.TemporaryDirectory(prefix="triton-") as triton,
    ):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "TRITON_CACHE_DIR": triton}
        with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
            command = [
                sys.executable,
                __file__,
                "--child-output",
                result.name,
                "--device",
                args.device,
                *(["--model", args.model] if args.model else []),
                "--load-format",
                args.load_format,
                "--kv-cache-tokens",
                str(args.kv_cache_tokens),
                "--extend-capture-tokens",
                args.extend_capture_tokens,
            ]
            child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
            if child.returncode != 0:
                raise RuntimeError(f"run {index} failed ({child.returncode}):\n{child.stderr[-4000:]}")
            with open(result.name, encoding="utf-8") as handle:
                run = json.load(handle)
    run["page_cache_dropped_files"] = dropped
    run["log"] = [
        line
        for line in child.stderr.splitlines()
        if any(f" {package}." in line for package in ("engine", "graphs", "backends"))
    ]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a path or preset (default: the embedded SmolLM2)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument(
        "--extend-capture-tokens", default="", help="token buckets captured as well (default: the config's)"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="before each run, drop the page cache of Python's, torch's and the driver's files",
    )
    parser.add_argument("--timeout-s", type=int, default=300)
    parser.add_argument("--output", default="bench_results/cold_capture.json")
    parser.add_argument("--child-output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_output:
        report = _profile_one_run(args)
        with open(args.child_output, "w", encoding="utf-8") as handle:
            json.dump(report, handle)
        return
    runs = [_run_fresh(args, i) for i in range(args.runs)]
    print(
        f"{'run':>3} {'decode s':>8} {'extend s':>8} {'all s':>6} {'graph MiB':>9} {'extend MiB':>10} "
        f"{'dynamo s':>8} {'imports':>7} {'build s':>7}"
    )
    for i, run in enumerate(runs):
        spans = run["spans"]
        print(
            f"{i:>3} {spans['decode_capture_s']:>8.2f} {spans['extend_capture_s']:>8.2f} "
            f"{spans['all_captures_s']:>6.2f} "
            f"{run['decode_graph_memory_mib'] or 0:>9.0f} {run['extend_graph_memory_mib'] or 0:>10.0f} "
            f"{run['compile_times_s'].get('_compile.compile_inner', 0):>8.2f} {run['modules_imported_in_captures']:>7} "
            f"{spans['engine_build_s']:>7.2f}"
        )
    median = statistics.median(run["spans"]["all_captures_s"] for run in runs)
    memory = statistics.median(
        (run["decode_graph_memory_mib"] or 0) + (run["extend_graph_memory_mib"] or 0) for run in runs
    )
    print(
        f"median capture of all graphs {median:.2f} s, {memory:.0f} MiB over {len(runs)} cold runs"
        f"{' (page cache dropped)' if args.drop_page_cache else ''}; the issue's budget: 10 s, 1 GiB"
    )
    import torch

    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "torch": torch.__version__,
                "device": args.device,
                "model": args.model,
                "load_format": args.load_format,
                "extend_capture_tokens": args.extend_capture_tokens,
                "drop_page_cache": args.drop_page_cache,
                "median_all_captures_s": median,
                "median_graph_memory_mib": memory,
                "budget": {"seconds": 10.0, "graph_memory_gib": 1.0},
                "runs": runs,
            },
            handle,
            indent=1,
        )


if __name__ == "__main__":
    main()
