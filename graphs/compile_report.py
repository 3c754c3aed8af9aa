"""What a capture spent compiling: dynamo/inductor's phases and the Triton kernels JIT-compiled in this process.

Capture cost is part of the product (a cold start is minutes of a GPU's time in a
fleet), so the capture log says where it went. Inductor compiles its own Triton
kernels in worker processes (their wait shows as a dynamo phase); the engine's
hand-written kernels (attention, GEMV, MoE) compile in this process at their first
launch, and Triton's compilation listener times each one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def compile_phase_seconds() -> dict[str, float]:
    """Seconds dynamo and inductor have spent so far in this process, per entry of dynamo's timing table
    (`compilation_time_metrics`, what `torch._dynamo.utils.compile_times()` prints)."""
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", {})
    return {name: float(sum(values)) for name, values in metrics.items()}


# The entries of dynamo's table that say where a compile went, outermost first: all of dynamo's compile,
# its tracing, the backend (AOT autograd + inductor), inductor's lowering and code generation, the
# wait for inductor's Triton kernels (compiled by its worker processes) and loading compiled modules.
PHASES = (
    "_compile.compile_inner",
    "bytecode_tracing",
    "OutputGraph.call_user_compiler",
    "compile_fx_inner",
    "GraphLowering.codegen",
    "async_compile.wait",
    "PyCodeCache.load_by_key_path",
)
PHASE_LABELS = {
    "_compile.compile_inner": "dynamo in all",
    "bytecode_tracing": "tracing",
    "OutputGraph.call_user_compiler": "backend",
    "compile_fx_inner": "inductor",
    "GraphLowering.codegen": "codegen",
    "async_compile.wait": "kernel wait",
    "PyCodeCache.load_by_key_path": "module load",
}


@dataclass
class CompileReport:
    """Filled by `compile_report()`: wall time, dynamo's phases, and the Triton JIT of this process."""

    wall_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    triton_compiles: int = 0
    triton_cache_hits: int = 0
    triton_compile_s: float = 0.0
    triton_kernels: dict[str, float] = field(default_factory=dict)  # kernel name -> seconds compiling it
    started: float = field(default_factory=time.perf_counter)
    phases_before: dict[str, float] = field(default_factory=dict)

    def update(self) -> None:
        """Wall time and dynamo's phases so far (done on leaving compile_report(); call it to read them inside)."""
        self.wall_s = time.perf_counter() - self.started
        self.phases_s = {
            name: seconds - self.phases_before.get(name, 0.0) for name, seconds in compile_phase_seconds().items()
        }

    def summary(self, top: int = 3) -> str:
        phases = [(PHASE_LABELS[n], self.phases_s[n]) for n in PHASES if self.phases_s.get(n, 0.0) >= 0.05]
        kernels = sorted(((s, n) for n, s in self.triton_kernels.items()), reverse=True)[:top]
        return (
            f"dynamo/inductor: {', '.join(f'{n} {s:.1f} s' for n, s in phases) or 'nothing'}; "
            f"Triton JIT here: {self.triton_compiles} kernels in {self.triton_compile_s:.1f} s "
            f"({', '.join(f'{n} {s:.1f} s' for s, n in kernels) or 'none'}), {self.triton_cache_hits} from its cache"
        )


@contextmanager
def compile_report() -> Iterator[CompileReport]:
    """Around a capture: what it compiled, read from dynamo's timing table and Triton's compilation listener
    (any listener already installed keeps being called)."""
    report = CompileReport(phases_before=compile_phase_seconds())
    knobs: Any = None
    previous = None
    try:
        import triton

        knobs = triton.knobs.compilation
        previous = knobs.listener
    except (ImportError, AttributeError):  # no Triton, or one without the listener (before 3.4)
        knobs = None

    def listen(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        if cache_hit:
            report.triton_cache_hits += 1
        else:
            seconds = times.total / 1e6
            report.triton_compiles += 1
            report.triton_compile_s += seconds
            name = getattr(getattr(src, "fn", None), "__name__", "kernel")
            report.triton_kernels[name] = report.triton_kernels.get(name, 0.0) + seconds
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    if knobs is not None:
        knobs.listener = listen
    try:
        yield report
    finally:
        if knobs is not None:
            knobs.listener = previous
        report.update()
