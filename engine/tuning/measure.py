"""Measure each candidate capture size with the engine's own graph runner: capture time, graph memory,
replay time, and eager step time.

The model, KV pool and platform are a real Engine's (built with graphs off, so it captures nothing of its
own); the runner is the class that engine would build (`platform.graph_runner_class()`, the arguments of
Engine._graph_runner). Each size is captured on its own call of the runner's `capture([size])`, so its
seconds and memory are its own:

- CPU (`compile`: one torch.compile entry per size) pays a compile per size, so a size costs its first
  capture; inductor's one-time start-up (imports, code cache) is paid beforehand by a throwaway compile
  and counted once (fixed).
- CUDA/ROCm (`cuda_graph`) with compile_decode compiles the step once for all sizes (dynamic batch), so
  every size is captured twice: the second pass is a size's own cost, the first pass's surplus the
  compile paid once (fixed). Each call records into a pool of its own, so a size's memory is an upper
  bound of what it adds to the engine's one shared pool; `verify` captures the chosen set as the engine
  does and reports the real figure.

Replays and eager steps are timed back to back (steady state, as serving runs them), over rows of
`context` tokens each in pages of their own, so attention reads as much KV as a real batch would.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from engine.platform import CaptureKind
from graphs.cuda_graph_runner import CudaGraphRunner

if TYPE_CHECKING:
    from engine.engine import Engine
    from graphs.step_runner import DecodeGraphRunner

logger = logging.getLogger(__name__)

# Runners built on graphs/step_runner.py's DecodeGraphRunner.
MEASURABLE_KINDS = (CaptureKind.COMPILE, CaptureKind.CUDA_GRAPH)


@dataclass
class SizeMeasurement:
    size: int
    replay_ms: float
    eager_ms: float
    capture_s: float  # what this size costs at start-up (see the module docstring)
    first_capture_s: float  # its first capture call, compile included
    memory_mib: float
    memory_source: str  # "device" (free device memory before/after) or "rss" (process resident memory)
    # inductor's FX graph cache during its first capture: a size compiled before on this machine (a hit)
    # captures in a fraction of a cold compile's time, so capture seconds depend on the cache's state.
    fx_cache_hits: int = 0
    fx_cache_misses: int = 0


@dataclass
class MeasureReport:
    sizes: list[SizeMeasurement]
    eager_points: dict[int, float]  # eager step ms by batch size (the candidates and any larger probe)
    fixed_capture_s: float
    fixed_memory_mib: float
    logits_mib_per_row: float  # the runner's static logits buffer, sized by the largest captured size (CUDA)
    capture_kind: str
    context: int
    iters: int
    machine: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["eager_points"] = {str(k): v for k, v in self.eager_points.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasureReport:
        values = dict(data)
        values["sizes"] = [SizeMeasurement(**s) for s in data["sizes"]]
        values["eager_points"] = {int(k): float(v) for k, v in data["eager_points"].items()}
        return cls(**values)


def machine_info(engine: Engine | None = None) -> dict[str, Any]:
    """What the figures were measured on: engine.bench's CPU, torch and Python facts, plus the device."""
    from engine.bench import machine_info as host_info

    info = host_info()
    if engine is not None:
        info["device"] = engine.platform.name
        info.update(engine.platform.device_facts())
    return info


def describe_machine(info: dict[str, Any]) -> str:
    where = (
        info.get("gpu")
        or f"{info.get('cpu_model')} ({info.get('cpu_count')} CPUs, {info.get('torch_num_threads')} threads)"
    )
    return f"{where}, torch {info.get('torch_version')}"


def make_runner(engine: Engine, sizes: Sequence[int]) -> DecodeGraphRunner:
    """The runner Engine._graph_runner would build for these sizes, not yet captured."""
    platform = engine.platform
    kind = platform.capture_settings().kind
    if kind not in MEASURABLE_KINDS:
        raise ValueError(
            f"tune-capture measures on cpu, cuda and rocm; the {platform.name} runner has no per-size capture and "
            "replay hooks (pass --cost-table with figures measured there)"
        )
    kwargs = engine.graph_runner_options()
    max_pages = -(-engine.max_model_len // engine.kv_pool.page_size)
    runner_cls = platform.graph_runner_class()
    return runner_cls(
        engine.model,
        engine.kv_pool.caches,
        sorted(set(sizes)),
        max_pages,
        engine.kv_pool.page_size,
        engine.device,
        platform.slot_index_dtype,
        **kwargs,
    )


def fill_rows(runner: DecodeGraphRunner, rows: int, context: int, vocab_size: int, seed: int = 0) -> None:
    """Static buffers of `rows` decode rows, each `context` tokens long in pages of its own (wrapping around
    the pool if it is smaller), so replays read as much KV as a real batch at that context would."""
    from graphs.static_buffers import StaticDecodeBuffers

    buffers = runner.buffers
    if not isinstance(buffers, StaticDecodeBuffers):  # a backend with capture hooks of its own
        raise ValueError(
            f"tune-capture fills StaticDecodeBuffers; this backend's capture state is {type(buffers).__name__}"
        )
    page_size = buffers.page_size
    pages_per_row = -(-context // page_size)
    pool_pages = runner.kv_caches[0][0].shape[0] // page_size - 1  # page 0 is the padding page
    if pages_per_row > buffers.page_table.shape[1]:
        raise ValueError(
            f"context {context} needs {pages_per_row} pages; the runner holds {buffers.page_table.shape[1]}"
        )
    generator = torch.Generator().manual_seed(seed)
    pages = 1 + (torch.arange(rows * pages_per_row) % max(pool_pages, 1)).reshape(rows, pages_per_row)
    table = torch.zeros(rows, buffers.page_table.shape[1], dtype=torch.int32)
    table[:, :pages_per_row] = pages.to(torch.int32)
    last = context - 1
    slots = pages[:, last // page_size] * page_size + last % page_size
    buffers.page_table[:rows].copy_(table)
    buffers.seq_lens[:rows].fill_(context)
    buffers.positions[:rows].fill_(last)
    buffers.slot_indices[:rows].copy_(slots.to(buffers.slot_indices.dtype))
    buffers.input_ids[:rows].copy_(torch.randint(1, max(vocab_size, 2), (rows,), generator=generator))


def steady_ms(sync: Callable[[], None], fn: Callable[[], object], iters: int, runs: int = 5) -> float:
    """Milliseconds per call of fn called back to back (median over `runs` groups), after two warm calls."""
    for _ in range(2):
        fn()
    per_run = max(1, iters // runs)
    samples = []
    for _ in range(min(runs, iters)):
        sync()
        start = time.perf_counter()
        for _ in range(per_run):
            fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3 / per_run)
    return statistics.median(samples)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="utf-8") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _fx_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])


def _prime_compiler() -> float:
    """Seconds of inductor's one-time start-up, paid on a throwaway function so no size is billed for it."""
    start = time.perf_counter()
    fn = torch.compile(lambda x: (x * 2 + 1).relu(), dynamic=False)
    fn(torch.ones(8))
    return time.perf_counter() - start


def measure_candidates(
    engine: Engine,
    candidates: Sequence[int],
    eager_sizes: Sequence[int],
    context: int,
    iters: int,
) -> MeasureReport:
    """Capture, replay and eager figures for every candidate size (see the module docstring)."""
    start = time.perf_counter()
    kind = engine.platform.capture_settings().kind
    sync = engine.platform.synchronize
    sizes = sorted({int(c) for c in candidates})
    eager_sizes = sorted({int(b) for b in eager_sizes} | set(sizes))
    runner = make_runner(engine, sizes)
    two_pass = kind is CaptureKind.CUDA_GRAPH
    bar = tqdm(total=len(sizes) * (3 if two_pass else 2) + len(eager_sizes), desc="tune-capture", unit="step")
    fixed_capture = _prime_compiler() if kind is CaptureKind.COMPILE else 0.0
    vocab = int(engine.model_config.vocab_size)
    # CudaGraphRunner writes every size's logits into one float32 buffer of the largest size, allocated in
    # the first capture call: billed per row of the largest chosen size, not to the size captured first.
    logits_per_row = vocab * 4 / 2**20 if kind is CaptureKind.CUDA_GRAPH else 0.0
    first: dict[int, float] = {}
    second: dict[int, float] = {}
    memory: dict[int, float] = {}
    cache: dict[int, tuple[int, int]] = {}
    for number, times in enumerate([first, second] if two_pass else [first]):
        for size in sorted(sizes, reverse=True):  # largest first, as the capture loop orders them
            bar.set_postfix_str(f"capture {size}" + (" (again)" if number else ""))
            rss, hits = rss_bytes(), _fx_cache_counts()
            sync()
            began = time.perf_counter()
            with torch.no_grad():
                runner.capture([size])  # one size per call: its own seconds and memory
            sync()
            times[size] = time.perf_counter() - began
            if number == 0:  # a second capture replaces the first's graph: its memory delta means nothing
                after = _fx_cache_counts()
                cache[size] = (after[0] - hits[0], after[1] - hits[1])
                held = runner.graph_memory_bytes / 2**20 if two_pass else max(0, rss_bytes() - rss) / 2**20
                memory[size] = max(0.0, held - (logits_per_row * size if size == max(sizes) else 0.0))
            bar.update()
    if two_pass:
        fixed_capture = max(0.0, sum(first.values()) - sum(second.values()))
    fill_rows(runner, max(sizes), context, vocab)

    def time_each(
        label: str,
        each: Sequence[int],
        step: Callable[[int], object],
        around: Callable[[int], AbstractContextManager[None]] | None = None,
    ) -> dict[int, float]:
        times: dict[int, float] = {}
        with torch.no_grad():
            for size in each:
                bar.set_postfix_str(f"{label} {size}")
                with around(size) if around is not None else nullcontext():
                    times[size] = steady_ms(sync, lambda size=size: step(size), iters)
                bar.update()
        return times

    @contextmanager
    def as_served(size: int) -> Iterator[None]:
        # A graph that reads padding rows past its size (CUDA's batch 1) replays over padding, as a served
        # step's would, not over the filled rows (filled again for the next size).
        rows = runner.graph_rows(size)
        if rows == size:
            yield
            return
        runner.buffers._pad(size, rows)
        try:
            yield
        finally:
            fill_rows(runner, max(sizes), context, vocab)

    replay = time_each("replay", sizes, runner._replay, as_served)
    if isinstance(runner, CudaGraphRunner):
        runner.graphs.clear()  # CUDA: this measurement's graphs (and their pools) go before the eager probes
    probe = make_runner(engine, [max(eager_sizes)])  # never captured: its buffers hold the eager batches
    fill_rows(probe, max(eager_sizes), context, vocab)
    eager = time_each("eager", eager_sizes, probe.step_eager)
    bar.close()
    source = "device" if two_pass else "rss"
    measured = [
        SizeMeasurement(
            size=s,
            replay_ms=replay[s],
            eager_ms=eager[s],
            capture_s=(second if two_pass else first)[s],
            first_capture_s=first[s],
            memory_mib=memory[s],
            memory_source=source,
            fx_cache_hits=cache[s][0],
            fx_cache_misses=cache[s][1],
        )
        for s in sizes
    ]
    return MeasureReport(
        measured,
        eager,
        fixed_capture,
        0.0,
        logits_per_row,
        kind,
        context,
        iters,
        machine_info(engine),
        time.perf_counter() - start,
    )
