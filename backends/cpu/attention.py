"""CPU attention: decode through the native paged kernel (backends/cpu/kernels/paged_decode.c).

The generic torch path gathers every request's context out of the pages before
SDPA, a copy of the whole context per layer per step; the native kernel reads
the pages in place (3-10x faster per call here). It handles float32 caches
(the CPU default, `kv_cache_dtype: float32`); anything else, or a machine
without gcc, takes the torch path. Prefill stays in torch ops.
"""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Any

import torch

from backends.cpu.native import load
from engine.layers.attention import AttentionMetadata
from engine.layers.ops import define_decode_attention_op
from engine.layers.torch_attention import TorchAttentionBackend, paged_decode_attention
from graphs.capture_hooks import StaticBufferCaptureHooks

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@cache
def _kernel() -> Any:
    """The ctypes function, typed once (looked up on every decode layer: keep it a cache hit)."""
    lib = load("paged_decode")
    if lib is None:
        return None
    fn = lib.paged_decode_f32
    fn.restype = _I
    fn.argtypes = [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I]
    return fn


def native_decode_available() -> bool:
    """The native kernel built and loaded here (not switched off, gcc present)."""
    return _kernel() is not None


def native_decode_supported(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor
) -> bool:
    """The kernel reads raw float32 [slots, kv_heads, dim] caches and int32 tables; anything else goes to torch."""
    return (
        _kernel() is not None
        and q.device.type == "cpu"
        and q.dim() == 3
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape
        and k_cache.dim() == 3
        and q.shape[-1] == k_cache.shape[-1]
        and q.shape[1] % k_cache.shape[1] == 0
        and page_table.dtype == seq_lens.dtype == torch.int32
        and page_table.shape[0] == seq_lens.shape[0] == q.shape[0]
    )


def cpu_paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_indices: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Store this step's k/v, then attend over each request's pages in place (a sliding window or
    soft-capped scores: the torch path, which the native kernel does not cover)."""
    if window > 0 or softcap or not native_decode_supported(q, k_cache, v_cache, page_table, seq_lens):
        return paged_decode_attention(
            q, k, v, k_cache, v_cache, slot_indices, page_table, seq_lens, page_size, scale, window, softcap
        )
    k_cache.index_copy_(0, slot_indices, k)
    v_cache.index_copy_(0, slot_indices, v)
    q = q.contiguous()
    page_table, seq_lens = page_table.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    status = _kernel()(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        page_table.data_ptr(),
        page_table.shape[1],
        seq_lens.data_ptr(),
        batch,
        heads,
        k_cache.shape[1],
        dim,
        page_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("native paged decode attention could not allocate its scratch buffer")
    return out


define_decode_attention_op("cpu_paged_decode", cpu_paged_decode)


class CpuAttentionBackend(StaticBufferCaptureHooks, TorchAttentionBackend):
    """TorchAttentionBackend with decode through the native kernel where it applies."""

    name = "cpu"

    def step_context(self, meta: AttentionMetadata) -> AbstractContextManager[Any]:
        if meta.is_decode and self.kv_dtype == torch.float32 and _kernel() is not None:
            return nullcontext()  # the kernel reads the page table itself: no per-step plan to build
        return super().step_context(meta)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        return torch.ops.engine.cpu_paged_decode(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_indices,
            meta.page_table,
            meta.seq_lens,
            meta.page_size,
            scale,
            window,
            softcap,
        )
