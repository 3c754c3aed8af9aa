"""CUDA/HIP graph capture of the whole decode step (model forward through logits).

Sizes are captured largest first into one shared memory pool on a side
stream, after one warm-up run each (Triton JIT, dynamo's recompile for a new
size and cuBLAS workspace happen outside capture; vLLM also warms up once). Python's GC is frozen during
capture: it made SGLang's capture 2-4x faster (PR #8577).

With `compile_step` the captured step is first compiled piecewise by
torch.compile (graphs/compiled_step.py), which fuses the norms, rotary and
activations into a few kernels per layer: a graph of 32 layers launches
~10 kernels a layer instead of ~45. The batch dimension is marked dynamic from
the first (largest) size, so all sizes share one compiled layer graph, where
dynamo's automatic dynamic shapes made three; its attention is the opaque
engine::step_attention, so the extend step runs the same compiled function
(`layer_fn`: one compile for both, graphs/opaque_attention.py). The final norm
and LM head run eagerly inside the graph, into the one logits buffer.
Batch 1 is captured over two rows, the second a padding row, because dynamo
specialises size 1 and would compile every piece again (~3 s of a cold
capture of Llama-3-8B); the linears compute the live row alone through the
one-row GEMV (engine/layers/live_rows.py). MoE models keep the size-1 compile:
the padding row would route to experts of its own and read their weights.
Graphs are then captured as usual.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from engine.layers.live_rows import only_first_rows_live
from engine.layers.moe import SparseMoE
from graphs.compile_report import CompileReport, compile_report
from graphs.compiled_step import CompiledDecodeStep, compile_count
from graphs.step_runner import DecodeGraphRunner

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the type torch.cuda.graph_pool_handle() returns

    from engine.layers.attention import AttentionMetadata
    from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)

# Eager runs before each capture. One is enough: everything lazy (kernel JIT, a dynamo recompile,
# cuBLAS handles) happens on the first call of a shape; a second run only cost capture time.
WARMUP_RUNS = 1


def free_device_memory() -> int:
    """Free bytes on the device once the caching allocator has returned its idle blocks: measured
    before and after capture, the difference is what the graph pool (and the static outputs) hold,
    not the warm-up runs' transient tensors."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@contextmanager
def frozen_gc() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


class CudaGraphRunner(DecodeGraphRunner):
    def __init__(
        self,
        *args: Any,
        compile_step: bool = False,
        precompile: Callable[[list[AttentionMetadata]], Callable[[], None]] | None = None,
        layer_fn: Callable[..., torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        """precompile: the platform's kernel_precompiler (its kernels compile in the background while the
        first size compiles; the function it returns waits for them before the first capture).
        layer_fn: the extend step's compiled layer step, to compile once for both (graphs/opaque_attention.py)."""
        super().__init__(*args, **kwargs)
        self.precompile = precompile
        self.compiled_step: CompiledDecodeStep | None = None
        if compile_step:
            # The head runs eagerly, writing into the logits buffer: a compile fewer (~0.5 s of a cold capture),
            # and no float32 logits of the largest size left in the pool (263 MiB at 512 rows of a 128k vocabulary).
            self.compiled_step = CompiledDecodeStep(
                self.model,
                self.kv_caches,
                dynamic=None,
                max_entries=16,
                dynamic_batch=True,
                opaque_attention=True,
                layer_fn=layer_fn,
                compile_head=False,
            )
        # Captured sizes whose graphs read more rows than the size (the rest are padding rows).
        self.padded_graph_rows: dict[int, int] = {}
        if self.compiled_step is not None and self.max_batch_size >= 2 and batch1_in_two_rows(self.model):
            self.padded_graph_rows[1] = 2
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every size writes its logits into one buffer: a graph's own output stays allocated in the pool
        # for good, and 20 sizes' float32 logits over a 128k vocabulary were 1.5 GiB of the 1.7 GiB pool.
        # One copy costs ~0.1 ms at batch 512. Steps run in stream order, so one buffer is safe (as one
        # size's output always was for two steps of the same size).
        self.logits: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None
        # The stream the graphs were captured on: the extend buckets capture on it too (Engine._extend_graphs),
        # since the caching allocator hands a pool's freed blocks only to allocations on the stream that freed them.
        self.capture_stream: torch.cuda.Stream | None = None
        # Benchmarks set a list here to get (start, end) CUDA events around every replay: the device
        # time of each step's graph, read after the run (engine/bench_throughput.py).
        self.replay_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        # Of the capture in progress (_capturing): warm-up seconds per size, compiles, the kernel precompile's wait.
        self._warmup_s: dict[int, float] = {}
        self._compiles_before = 0
        self._compiled = CompileReport()
        self._wait_for_precompile: Callable[[], None] | None = None

    @contextmanager
    def _capturing(self) -> Iterator[None]:
        """Around the loop: one pool and one side stream for every size, the GC frozen, dynamo's compiles
        counted, and the platform's kernels compiling in the background until the first capture."""
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream()
        self._warmup_s = {}  # per size: the eager runs before capture (compiles and JIT land here)
        self._compiles_before = compile_count()
        sizes = sorted(self.capture_sizes, reverse=True)
        with torch.no_grad(), frozen_gc(), compile_report() as self._compiled:
            # Kernels compiled ahead for the largest size (one pass) and the smallest (split-K decode).
            self._wait_for_precompile = (
                self.precompile([self.capture_metadata(self.graph_rows(bs)) for bs in (sizes[0], sizes[-1])])
                if self.precompile is not None
                else None
            )
            try:
                yield
            finally:
                if self._wait_for_precompile is not None:  # a warm-up that raised: the compile threads still stop
                    self._wait_for_precompile()
                    self._wait_for_precompile = None

    def _capture_size(self, bs: int) -> None:
        stream = self.capture_stream
        assert stream is not None
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            self.hooks.prepare_for_capture(self.buffers, self.graph_rows(bs))
            for _ in range(WARMUP_RUNS):
                warm_logits = self._captured_step(bs)
        stream.synchronize()
        if self._wait_for_precompile is not None:  # no compile thread may touch the device during a capture
            self._wait_for_precompile()
            self._wait_for_precompile = None
        self._warmup_s[bs] = time.perf_counter() - started
        if self.logits is None:  # sized by the largest batch, outside the pool
            self.logits = torch.empty_like(warm_logits)
        del warm_logits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self._captured_step(bs, out=self.logits[:bs])
        self.outputs[bs] = self.logits[:bs]
        self.graphs[bs] = graph
        self.hooks.after_capture(self.buffers, bs, graph)
        stream.synchronize()

    def _free_memory(self) -> Callable[[], int]:
        return free_device_memory

    def _capture_summary(self) -> str:
        slowest = sorted(self._warmup_s.items(), key=lambda item: -item[1])[:3]
        self._compiled.update()
        sizes = ", ".join(f"size {bs} {s:.1f} s" for bs, s in slowest)
        return (
            f"warm-up runs {sum(self._warmup_s.values()):.1f} s (slowest: {sizes}); "
            f"{compile_count() - self._compiles_before} dynamo graphs compiled; {self._compiled.summary()}"
        )

    def graph_rows(self, bs: int) -> int:
        return self.padded_graph_rows.get(bs, bs)

    def _captured_step(self, bs: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step a graph of `bs` rows captures: its float32 logits, written into `out` when given."""
        if self.compiled_step is None:
            logits = self.step_eager(bs)
            return logits if out is None else out.copy_(logits)
        buffers, rows = self.buffers, self.graph_rows(bs)
        with only_first_rows_live(bs) if rows > bs else nullcontext():
            hidden = self.compiled_step.hidden_states(
                buffers.input_ids[:rows], buffers.positions[:rows], self.capture_metadata(rows)
            )
            return self.compiled_step.logits(hidden[:bs], out)

    def _replay(self, bs: int) -> torch.Tensor:
        self.hooks.before_replay(self.buffers, bs, self.graphs[bs])
        if self.replay_events is None:
            self.graphs[bs].replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graphs[bs].replay()
            end.record()
            self.replay_events.append((start, end))
        return self.outputs[bs]


def batch1_in_two_rows(model: CausalLM) -> bool:
    """Whether batch 1 is captured over two rows (see the module docstring): not for MoE models, whose
    padding row would route to experts of its own and read their weights."""
    return not any(isinstance(module, SparseMoE) for module in model.modules())
