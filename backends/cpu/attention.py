"""CPU attention: decode through the native paged kernel (backends/cpu/kernels/paged_decode.c), prefill through a
bf16 one (backends/cpu/kernels/prefill_attention_bf16.c) where the CPU has AVX512-BF16 and it was chosen.

The generic torch path gathers every request's context out of the pages before
SDPA, a copy of the whole context per layer per step; the native kernel reads
the pages in place (3-10x faster per call here). It handles float32 caches
(the CPU default, `kv_cache_dtype: float32`); anything else, or a machine
without gcc, takes the torch path. Prefill runs SDPA in float32, or, in steps whose every request has at least
PREFILL_BF16_ATTENTION_ROWS new tokens and where --cpu-prefill-attention chose it, the bf16 kernel: 2.5x
SDPA's speed on a 1,500-token prompt (9 against 22 ms a layer, SmolLM2, 2 threads, AVX512-BF16 without AMX).
"""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Any

import torch

from backends.cpu.features import cpu_features
from backends.cpu.native import load
from engine.config import CPU_PREFILL_ATTENTION
from engine.errors import EngineError
from engine.layers.attention import AttentionMetadata
from engine.layers.ops import define_decode_attention_op
from engine.layers.torch_attention import TorchAttentionBackend, gather_context, paged_decode_attention
from graphs.capture_hooks import StaticBufferCaptureHooks

_P, _I, _F, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
# A request takes the bf16 prefill kernel from this many new tokens: the rows from which a GGUF model's matmuls run on
# their bf16 copy (backends/cpu/gguf_linear.py's PREFILL_MIN_ROWS). Below that a step is decode-like and SDPA's cost
# is small; above it the kernel wins at every length, SDPA's fixed cost a call included (SmolLM2, 2 threads, time
# to first token: 40 tokens 56 -> 52 ms, 128 tokens 119 -> 110 ms, 1,500 tokens ~1.75 -> ~1.25 s).
PREFILL_BF16_ATTENTION_ROWS = 32


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


def bf16_prefill_cpu() -> bool:
    """The kernel's instructions (vdpbf16ps, AVX512F), as ENGINE_CPU_HIDE_FEATURES leaves them."""
    return cpu_features().avx512 and cpu_features().has("avx512_bf16")


@cache
def _prefill_kernel() -> Any:
    """kernels/prefill_attention_bf16.c typed once; None without AVX512-BF16 (never loaded there) or gcc."""
    if not bf16_prefill_cpu():
        return None
    lib = load("prefill_attention_bf16")
    if lib is None:
        return None
    fn = lib.prefill_attention_bf16
    fn.restype = _I
    fn.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I64, _I64, _I64, _F, _I]
    return fn


def choose_prefill_attention(mode: str, bf16_matmuls: bool) -> tuple[bool, str]:
    """(run prefill attention on the bf16 kernel?, why) for --cpu-prefill-attention `mode`; bf16_matmuls:
    the prefill's matmuls already round their inputs to bf16 (a GGUF model's packed bf16 copy)."""
    if mode not in CPU_PREFILL_ATTENTION:
        raise EngineError(f"--cpu-prefill-attention {mode!r}: choose one of {', '.join(CPU_PREFILL_ATTENTION)}")
    if mode == "float32":
        return False, "--cpu-prefill-attention float32"
    if not bf16_prefill_cpu():
        if mode == "bf16":
            raise EngineError(f"--cpu-prefill-attention bf16 needs AVX512-BF16 ({cpu_features().describe()})")
        return False, f"no AVX512-BF16 on this CPU ({cpu_features().describe()})"
    if _prefill_kernel() is None:
        if mode == "bf16":
            raise EngineError("--cpu-prefill-attention bf16: its native kernel could not be built here (see the log)")
        return False, "the native kernel is unavailable (see the log)"
    if mode == "bf16":
        return True, "--cpu-prefill-attention bf16"
    if not bf16_matmuls:
        return False, "the prefill's matmuls run in float32 (exact numerics asked for, or no bf16 copy)"
    return True, "AVX512-BF16, and the prefill's matmuls already run in bf16"


def bf16_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """extend_attention's causal attention (no window, no soft-cap) through the bf16 kernel, one call a request;
    q [tokens, heads, D], this step's k / v [tokens, kv_heads, D] (already stored), all float32. A request without
    a cached prefix reads its keys from k and v (no gather from the pages)."""
    assert meta.query_start_loc is not None and meta.seq_lens_cpu is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if seq_len == end - start:
            keys, values = k[start:end], v[start:end]
        else:
            pages = meta.page_table[i, : -(-seq_len // meta.page_size)]
            keys = gather_context(k_cache, pages, meta.page_size)[:seq_len]
            values = gather_context(v_cache, pages, meta.page_size)[:seq_len]
        status = _prefill_kernel()(
            q[start].data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out[start].data_ptr(),
            end - start,
            seq_len,
            heads,
            keys.shape[1],
            dim,
            q.stride(0),
            keys.stride(0),
            out.stride(0),
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"bf16 prefill attention refused q {tuple(q.shape)}, keys {tuple(keys.shape)}: {status}")
    return out


class CpuAttentionBackend(StaticBufferCaptureHooks, TorchAttentionBackend):
    """TorchAttentionBackend with decode through the native kernel where it applies."""

    name = "cpu"
    # Set by CpuPlatform.prepare_model (--cpu-prefill-attention): prefill steps whose every request has at least
    # this many new tokens run the bf16 kernel; 0: SDPA in float32 always.
    bf16_prefill_rows = 0

    def bf16_prefill_applies(self, q: torch.Tensor, meta: AttentionMetadata, window: int, softcap: float) -> bool:
        """This extend step runs on the bf16 kernel: chosen, every request long enough, a head size the kernel
        takes, and no sliding window or soft-cap (which it does not implement); forward also asks for a float32
        cache."""
        if not self.bf16_prefill_rows or meta.is_decode or window > 0 or softcap or _prefill_kernel() is None:
            return False  # (the kernel is asked again: forget_cpu_paths may have hidden it since the choice)
        if q.shape[-1] % 64 or q.shape[-1] > 256 or meta.query_start_loc is None:
            return False
        starts = meta.query_start_loc
        return all(starts[i + 1] - starts[i] >= self.bf16_prefill_rows for i in range(len(starts) - 1))

    def forward(
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
        if not self.bf16_prefill_applies(q, meta, window, softcap) or k_cache.dtype != torch.float32:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        out_dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        k_cache.index_copy_(0, meta.slot_indices, k)
        v_cache.index_copy_(0, meta.slot_indices, v)
        return bf16_prefill_attention(q, k, v, k_cache, v_cache, meta, scale).to(out_dtype)

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
