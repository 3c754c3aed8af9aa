"""Steps whose trailing rows are padding, for the ops that can skip them.

The CUDA runner captures its batch-1 decode graph over two rows, the second a dummy row, so that the
compiled step never meets a batch of one: dynamo specialises size 1 and would compile every piece a
second time, ~3 s of a cold capture (graphs/cuda_graph_runner.py). Most of the step does not care
about one more row, but the linears do: one row goes through a GEMV that reads each weight once,
two rows through cuBLAS, ~0.5 ms slower a step on Llama-3-8B. So while that graph is captured, the
ops that choose a kernel by their rows (the GEMV linears) ask here how many rows are real, compute
those, and write zeros to the rest. Every op of a decode step is row-independent, so the padding
row's values never reach a real row either way; zeros keep it finite.

Read at run time inside the ops (Python that runs during warm-up and capture), never in traced code:
a compiled graph holds no branch on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_LIVE_ROWS: ContextVar[int | None] = ContextVar("engine_live_rows", default=None)


@contextmanager
def only_first_rows_live(rows: int) -> Iterator[None]:
    """Inside the block, ops may treat every input row after the first `rows` as padding."""
    if rows < 1:
        raise ValueError(f"at least one row is live, got {rows}")
    token = _LIVE_ROWS.set(rows)
    try:
        yield
    finally:
        _LIVE_ROWS.reset(token)


def live_rows(rows: int) -> int:
    """How many of an op's `rows` leading input rows are real: all of them outside only_first_rows_live."""
    live = _LIVE_ROWS.get()
    return rows if live is None else min(rows, live)
