"""Kernel time out of a torch.profiler run, shared by the benchmarks that list where device time went."""

from __future__ import annotations

from collections import defaultdict
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
