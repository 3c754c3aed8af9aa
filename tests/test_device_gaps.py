"""benchmarks/device_gaps.py's trace analysis, on a CPU trace: a host op that waits inside a step is named."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.device_gaps import analyse


def test_slow_host_op_inside_a_step_is_reported_with_its_offset() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("STEP"):
                torch.ones(4) + 1  # fast: below the threshold
                with torch.profiler.record_function("waits_for_device"):
                    time.sleep(0.03)
    report = analyse(prof, gap_us=300.0, slow_op_us=10_000.0)
    assert [op["op"] for op in report["slow_host_ops"]] == ["waits_for_device", "waits_for_device"]
    assert [op["step"] for op in report["slow_host_ops"]] == [0, 1]
    assert all(op["ms"] >= 30.0 for op in report["slow_host_ops"])
    assert len(report["step_host_ms"]) == 2 and report["gaps"] == [] and report["kernels"] == 0
