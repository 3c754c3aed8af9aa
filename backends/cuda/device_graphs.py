"""CUDA graphs for work beside the step runners (engine.platform.DeviceGraphs): the EAGLE-3 head's draft loop.

Every graph captured here shares one memory pool: the functions are replayed one at a time on the current
stream and keep nothing they allocate past a replay (their inputs and outputs are persistent tensors), so
the pool holds the largest graph's temporaries, not their sum. The decode graphs keep a pool of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_RUNS = 1  # cuBLAS picks its kernels and workspaces outside the capture


class CudaDeviceGraphs:
    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_RUNS):
                fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph.replay  # the bound method keeps the graph: dropping it frees the graph
