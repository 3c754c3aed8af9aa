"""What the GPU benchmarks share: timing calls replayed from one CUDA graph, the device copy rate, presets.

Used by benchmarks/gemv_sweep.py, moe_kernel.py and fp8_linear.py (run as scripts with PYTHONPATH=.).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.loader.resolve import PRESET_DIR


def graph_us(calls: Sequence[Callable[[], Any]], replays: int = 20, groups: int = 5) -> float:
    """Microseconds per call: each call run once outside the capture (JIT, allocations) on a side stream,
    then all of them captured in one CUDA graph in order; the median over `groups` timed groups of
    `replays` replays, divided by the number of calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(groups):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(samples)


def copy_rate_bytes_per_s(num_bytes: int = 2 * 1024**3) -> float:
    """Device memory's rate as a large device-to-device copy reaches it (bytes read + written per second)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)], replays=10)
    return 2 * num_bytes / (us * 1e-6)


def preset_config(name: str) -> dict[str, Any]:
    """The HF config of a model preset (configs/models/<name>.json), as `--model NAME --load-format dummy` reads it."""
    with open(os.path.join(PRESET_DIR, f"{name}.json"), encoding="utf-8") as handle:
        return json.load(handle)
