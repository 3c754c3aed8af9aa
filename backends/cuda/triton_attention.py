"""The Triton attention backend (CUDA and ROCm): every kernel capturable in a graph.

- decode: backends/cuda/triton_decode.py (one pass, or split-K at small batch);
- extend, prefill chunks and mixed steps: backends/cuda/triton_extend.py, the
  whole ragged batch in one launch. A mixed step's leading decode rows (one
  token each, `meta.num_decodes` of them) go to the decode kernel, which
  splits long contexts over more programs than one query token's tile would.
The torch path (engine.layers.torch_attention) is the reference both are tested against.
"""

from __future__ import annotations

import torch

from backends.cuda.triton_build import compile_only, interpreted
from backends.cuda.triton_decode import paged_decode_attention_triton
from backends.cuda.triton_extend import ragged_paged_attention
from engine.layers.attention import AttentionBackend, AttentionCapabilities, AttentionMetadata
from engine.layers.ops import DECODE_ATTENTION_SCHEMA, decode_attention_fake, define_op
from graphs.capture_hooks import StaticBufferCaptureHooks

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)


def store_kv_rows(
    cache: torch.Tensor, slot_indices: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    """cache[slot_indices] = rows; an FP8 cache takes rows / scale (a float32 scalar on the device: the
    checkpoint's k_scale or v_scale; None: unit scale, vLLM's default without calibrated ones)
    saturated to e4m3's range (a plain cast would make NaN of anything past 448)."""
    if cache.dtype == FP8_KV_DTYPE:
        if scale is not None:
            rows = rows.float() / scale  # divided as the decode kernel's own store divides
        # index_copy_ has no float8 kernel (CPU or CUDA): the e4m3 bytes are copied as bytes.
        rows = rows.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)
        cache.view(torch.uint8).index_copy_(0, slot_indices, rows.view(torch.uint8))
        return
    cache.index_copy_(0, slot_indices, rows)


def triton_paged_decode(
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """This step's k/v stored and attended to in one Triton launch (the kernel writes them), one opaque
    op so torch.compile leaves it alone. The kernel reads the new rows in the cache's own dtype or
    rounds them through e4m3; any other pairing (and an FP8 cache under Triton's interpreter, which
    narrows float32 to e4m3 wrongly) is stored by torch first. k_scale, v_scale: an FP8 cache's
    per-tensor scales (float32 scalars on the device), or None for unit scale."""
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    k, v = (row if row.stride(-1) == 1 else row.contiguous() for row in (k, v))  # the kernel steps dim by 1
    if (fp8 and interpreted()) or (not fp8 and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype)):
        store_kv_rows(k_cache, slot_indices, k, k_scale)
        store_kv_rows(v_cache, slot_indices, v, v_scale)
        return paged_decode_attention_triton(
            q, k_cache, v_cache, page_table, seq_lens, page_size, scale, window=window, softcap=softcap, **scales
        )
    return paged_decode_attention_triton(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        page_size,
        scale,
        window=window,
        softcap=softcap,
        new_kv=(k, v, slot_indices),
        fp8_max=FP8_KV_MAX if fp8 else 0.0,
        **scales,
    )


# The shared decode schema plus an FP8 cache's scales: only this backend reads FP8 caches.
define_op(
    "triton_paged_decode",
    DECODE_ATTENTION_SCHEMA.replace(
        "float softcap=0.0)", "float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None)"
    ),
    triton_paged_decode,
    decode_attention_fake,
)


class TritonAttentionBackend(StaticBufferCaptureHooks, AttentionBackend):
    """Decode and ragged extend through the Triton kernels; decode rows' k/v (a decode step's, and a mixed
    step's leading rows) stored by the decode kernel, prefill chunks' with one index_copy_ per cache
    (both capturable)."""

    name = "triton"
    capabilities = AttentionCapabilities(
        sliding_window=True,
        softcap=True,  # held to HF (eager) on the H200: tests/test_cuda.py
        fp8_kv=True,  # the kernels widen e4m3 K/V in registers
        # This step's k/v may be strided views ([tokens, kv_heads, dim], dim contiguous): the decode kernel
        # reads them through their strides, index_copy_ stores a prefill's.
        strided_kv=True,
    )

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
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """window: a sliding window (each query sees its last `window` positions); 0 for none.
        softcap: Gemma 2's soft-capped scores; 0 for none. k_scale, v_scale: an FP8 cache's per-tensor
        scales (float32 scalars on the device; None: unit scale)."""
        if meta.is_decode:
            return torch.ops.engine.triton_paged_decode(
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
                k_scale,
                v_scale,
            )
        assert meta.query_starts is not None, "extend metadata without device query offsets"
        decodes = meta.num_decodes
        if decodes == 0:
            store_kv_rows(k_cache, meta.slot_indices, k, k_scale)  # the whole ragged batch's k/v in one launch
            store_kv_rows(v_cache, meta.slot_indices, v, v_scale)
            return ragged_paged_attention(
                q,
                k_cache,
                v_cache,
                meta.query_starts,
                meta.seq_lens,
                meta.page_table,
                meta.page_size,
                scale,
                window,
                softcap,
                k_scale,
                v_scale,
            )
        # A mixed step: the prefill chunks' k/v stored here, the decode rows' by the decode kernel, as in the
        # decode graphs. The same compiled kernel variants serve both, so the first mixed steps compile
        # nothing (they used to JIT a store-less variant per split count in the middle of serving).
        out = torch.empty_like(q)
        out[:decodes] = triton_paged_decode(
            q[:decodes],
            k[:decodes],
            v[:decodes],
            k_cache,
            v_cache,
            meta.slot_indices[:decodes],
            meta.page_table[:decodes],
            meta.seq_lens[:decodes],
            meta.page_size,
            scale,
            window,
            softcap,
            k_scale,
            v_scale,
        )
        if q.shape[0] > decodes:
            store_kv_rows(k_cache, meta.slot_indices[decodes:], k[decodes:], k_scale)
            store_kv_rows(v_cache, meta.slot_indices[decodes:], v[decodes:], v_scale)
            out[decodes:] = ragged_paged_attention(
                q[decodes:],
                k_cache,
                v_cache,
                meta.query_starts[decodes:] - decodes,
                meta.seq_lens[decodes:],
                meta.page_table[decodes:],
                meta.page_size,
                scale,
                window,
                softcap,
                k_scale,
                v_scale,
            )
        return out

    def precompile_kernels(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        decode_metas: list[AttentionMetadata],
    ) -> int:
        """Compile ahead (compile_only launches) every attention kernel variant the decode graphs and
        extend/mixed steps will launch: decode with and without split-K at each capture metadata given,
        and the ragged kernel, for each kind of attention layer (window, soft-cap) the model has.
        Returns the launches made; the decode graphs' own launches then find the kernels compiled."""
        from engine.layers.attention import Attention

        kinds: dict[tuple, tuple[Attention, tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer, cache in zip(model.decoder_layers(), kv_caches):
            for attention in (m for m in layer.modules() if isinstance(m, Attention)):
                key = (
                    attention.num_heads,
                    attention.num_kv_heads,
                    attention.head_dim,
                    bool(attention.sliding_window),
                    attention.softcap > 0,
                )
                kinds.setdefault(key, (attention, cache))
        dtype = model_activation_dtype(model)
        device = kv_caches[0][0].device
        launches = 0
        with compile_only():
            for attention, (k_cache, v_cache) in kinds.values():
                window, softcap = attention.sliding_window or 0, attention.softcap
                heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
                # An FP8 cache's scales select the kernels' scaled variants, as the layers' own calls do.
                k_scale, v_scale = attention.kv_scales_for(k_cache)
                for meta in decode_metas:
                    bs = meta.slot_indices.shape[0]
                    q = torch.empty(bs, heads, dim, dtype=dtype, device=device)
                    kv = torch.empty(bs, kv_heads, dim, dtype=dtype, device=device)
                    triton_paged_decode(
                        q,
                        kv,
                        kv,
                        k_cache,
                        v_cache,
                        meta.slot_indices,
                        meta.page_table,
                        meta.seq_lens,
                        meta.page_size,
                        attention.scale,
                        window,
                        softcap,
                        k_scale,
                        v_scale,
                    )
                    launches += 1
                meta = decode_metas[0]
                tokens = 16
                q = torch.empty(tokens, heads, dim, dtype=dtype, device=device)
                ragged_paged_attention(
                    q,
                    k_cache,
                    v_cache,
                    torch.tensor([0, tokens], dtype=torch.int32, device=device),
                    torch.full((1,), tokens, dtype=torch.int32, device=device),
                    meta.page_table[:1],
                    meta.page_size,
                    attention.scale,
                    window,
                    softcap,
                    k_scale,
                    v_scale,
                )
                launches += 1
        return launches


def model_activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype activations (q, k, v) have: the embedding's (quantized linears keep float activations)."""
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.element_size() >= 2:
            return parameter.dtype
    return torch.get_default_dtype()
