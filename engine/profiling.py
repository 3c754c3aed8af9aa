"""torch.profiler for the benchmarks: kernel time by name, and chrome traces of a block."""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch


def time_by_name(prof: Any, on_gpu: bool) -> list[tuple[str, int, float]]:
    """(name, calls, microseconds) per kernel, most time first: on a GPU each device kernel's time (CUPTI
    sees kernels inside graph replays too); on the CPU each host op's self time, so that nested ops are
    not counted twice."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if on_gpu:
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_name[event.name][0] += 1
                per_name[event.name][1] += event.device_time_total
    else:
        for average in prof.key_averages():
            per_name[average.key] = [average.count, average.self_cpu_time_total]
    return sorted(((name, int(count), float(us)) for name, (count, us) in per_name.items()), key=lambda row: -row[2])


@contextlib.contextmanager
def chrome_trace(trace_dir: str | None, name: str) -> Iterator[None]:
    """A torch.profiler chrome trace (host ops and device kernels) of the block into trace_dir/name.json.gz,
    where the host's launches and waits show beside the device's kernels and side streams; nothing without a
    trace_dir."""
    if trace_dir is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(trace_dir, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(os.path.join(trace_dir, f"{name}.json.gz"))
