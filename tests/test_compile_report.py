"""graphs/compile_report.py: the capture log's account of what was compiled."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import reset_dynamo

from graphs.compile_report import compile_report


def test_dynamo_phases_of_a_compile_inside_the_report() -> None:
    reset_dynamo()
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
    with compile_report() as report:
        fn(torch.randn(8))
    assert report.wall_s > 0
    assert max(report.phases_s.values()) > 0  # the compile above shows in dynamo's timing table
    assert "dynamo/inductor:" in report.summary()


def test_triton_listener_counts_compiles_and_keeps_the_previous_listener() -> None:
    import triton  # a test requirement (setup.cfg), pinned at a version with the compilation listener

    calls = []

    def previous(**kwargs) -> None:
        calls.append(kwargs["cache_hit"])

    triton.knobs.compilation.listener = previous
    try:
        with compile_report() as report:
            listener = triton.knobs.compilation.listener
            src = SimpleNamespace(fn=SimpleNamespace(__name__="paged_decode_kernel"))
            times = SimpleNamespace(total=1_500_000)  # microseconds
            listener(src=src, metadata={}, metadata_group={}, times=times, cache_hit=False)
            listener(src=src, metadata={}, metadata_group={}, times=times, cache_hit=True)
        assert triton.knobs.compilation.listener is previous  # restored on exit
    finally:
        triton.knobs.compilation.listener = None
    assert calls == [False, True]
    assert (report.triton_compiles, report.triton_cache_hits) == (1, 1)
    assert report.triton_kernels == {"paged_decode_kernel": 1.5}
    assert "1 kernels in 1.5 s (paged_decode_kernel 1.5 s), 1 from its cache" in report.summary()
