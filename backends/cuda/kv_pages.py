"""engine.kv_host_tier.PageMover on CUDA: one Triton launch per staged chunk moves a page of every layer's k and v
(backends/cuda/kernels/kv_pages.py), where the portable mover launches one gather per tensor (64 for Llama-3-8B)
beside the compute stream's kernels."""

from __future__ import annotations

import torch
import triton

from backends.cuda.triton_build import load_kernel

KERNELS = "backends.cuda.kernels.kv_pages"
BLOCK = 1024  # words per program


class TritonPageMover:
    def __init__(self) -> None:
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}  # base addresses -> their table on the device

    def _table(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        # The pool's tensors live as long as the engine: their table is built once.
        key = tuple(t.data_ptr() for t in tensors)
        table = self._tables.get(key)
        if table is None:
            table = torch.tensor(key, dtype=torch.int64).to(device)
            self._tables[key] = table
        return table

    def _launch(
        self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor, to_staging: bool
    ) -> None:
        num_pages, num_tensors, words = staging.shape
        if num_pages == 0:
            return
        assert all(t.is_contiguous() for t in tensors) and staging.is_contiguous()
        grid = (num_pages, num_tensors, triton.cdiv(words, BLOCK))
        load_kernel(KERNELS, "kv_pages_kernel")[grid](
            self._table(tensors, staging.device), pages, staging, words, num_tensors, TO_STAGING=to_staging, BLOCK=BLOCK
        )

    def gather(self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None:
        self._launch(tensors, pages, staging, to_staging=True)

    def scatter(self, tensors: list[torch.Tensor], pages: torch.Tensor, staging: torch.Tensor) -> None:
        self._launch(tensors, pages, staging, to_staging=False)


TRITON_PAGE_MOVER = TritonPageMover()
