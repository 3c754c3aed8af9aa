"""Attention metadata and the Attention layer: the only place that touches the KV cache."""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; tensors live on the model's device.

    For decode every request contributes one query token; for extend (prefill
    chunks, and mixed steps) `query_start_loc` and `seq_lens_cpu` describe the
    ragged batch on the host and `query_starts` on the device. A mixed step puts
    its decode rows first: the first `num_decodes` requests have one new token
    each (a hint; any backend may treat them as short extends).
    The graph runners own static copies of the decode tensors and fill them in place.
    """

    is_decode: bool
    slot_indices: torch.Tensor  # [tokens] where each new token's k/v goes
    page_table: torch.Tensor  # [batch, pages] int32 page ids, 0-padded
    seq_lens: torch.Tensor  # [batch] int32 context length including new tokens
    page_size: int
    query_start_loc: list[int] | None = None  # extend only: [batch + 1] offsets into the tokens
    seq_lens_cpu: list[int] | None = None  # extend only
    query_starts: torch.Tensor | None = None  # extend only: query_start_loc on the device, int32
    num_decodes: int = 0  # extend only: leading requests with one new token each (a mixed step's decodes)
    # A compiled step whose layer graph takes no metadata (graphs/opaque_attention.py): attention runs as
    # the opaque engine::step_attention op, which finds this metadata in its context.
    opaque_attention: bool = False
    # Backend-specific extras a graph runner prepares (e.g. HPU's flat block list + mapping).
    platform_metadata: Any = None


@dataclass(frozen=True)
class AttentionCapabilities:
    """What an attention backend implements beyond plain causal attention over a float KV cache. The engine
    reads these before the model runs; a layer never calls a backend with an argument it does not declare
    (attention_extras)."""

    sliding_window: bool = False  # takes window= (each query sees its last `window` positions)
    softcap: bool = False  # takes softcap= (Gemma 2's cap * tanh(score / cap))
    fp8_kv: bool = False  # reads and writes an FP8 (e4m3) KV cache, takes k_scale= and v_scale=
    # Reads this step's k and v through their strides (views of a fused qkv projection), so the layer
    # skips the .contiguous() copies: one kernel a layer in every compiled step.
    strided_kv: bool = False


class AttentionBackend(abc.ABC):
    """Per-platform attention, chosen by Platform.attention_backend(); the only code that touches the KV cache.

    A subclass declares its `capabilities` and, where its platform's decode runner builds per-runner
    capture/replay hooks (graphs/capture_hooks.py), their class in `graph_hooks`."""

    name: ClassVar[str] = "base"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities()
    # The capture/replay hooks class this backend's platform runner builds with its own settings (HPU: the
    # buckets; NPU: the graph.update key); None: the decode graph runner's (the backend itself where it is
    # a graphs.capture_hooks.CaptureHooks, else the static-buffer default).
    graph_hooks: ClassVar[type[object] | None] = None
    # The KV cache's dtype, set by the engine before the first step: what a backend that builds per-step
    # tensors for the cache (the torch backend's additive masks) builds them in.
    kv_dtype: torch.dtype = torch.float32

    def step_context(self, meta: AttentionMetadata) -> AbstractContextManager[Any]:
        """Entered around one forward pass (eager, or a compiled step); per-step shared work goes here
        (nothing by default)."""
        return nullcontext()

    def precompile_kernels(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        decode_metas: list[AttentionMetadata],
    ) -> int:
        """Compile the backend's own kernels ahead for these capture metadata (the CUDA platform calls it in the
        background while the decode step compiles); returns the launches made: none by default."""
        return 0

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's k/v at meta.slot_indices and attend; q [tokens, heads, dim], k/v [tokens, kv_heads,
        dim]. A backend with a capability takes its keyword too (AttentionCapabilities)."""


def step_context(backend: AttentionBackend | None, meta: AttentionMetadata) -> AbstractContextManager[Any]:
    """The backend's per-step context; none before a backend is set."""
    return backend.step_context(meta) if backend is not None else nullcontext()


class Attention(nn.Module):
    """Stores this step's k/v at the batch's slots and attends over the page table."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        # Scores soft-capped to softcap * tanh(score / softcap) (Gemma 2); only backends whose capabilities
        # include softcap run such a model (the engine refuses it elsewhere).
        self.softcap = float(softcap or 0.0)
        # Each query sees its last `sliding_window` positions (None: all of them). Only backends whose
        # capabilities include sliding_window get a window; for the others the engine keeps the context
        # within the window instead.
        self.sliding_window = sliding_window
        self.backend: AttentionBackend | None = None  # set by the model runner
        # An FP8 KV cache holds k / k_scale and v / v_scale: per-tensor float32 scalars on the device
        # (vLLM's and SGLang's k_scale / v_scale), calibrated in the checkpoint or 1.0. Set once at load
        # (engine/quantization/kv_scales.py) and read by the kernels on the device, so a captured graph
        # needs no host value. Not persistent: they are not weights the loaders fill.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def set_kv_scales(self, k_scale: float, v_scale: float, device: torch.device) -> None:
        """This layer's FP8 KV cache scales, as float32 scalars on `device` (after loading: a model
        built on the meta device and cast to the model dtype has neither values nor float32 here)."""
        self.k_scale = torch.tensor(k_scale, dtype=torch.float32, device=device)
        self.v_scale = torch.tensor(v_scale, dtype=torch.float32, device=device)

    def kv_scales_for(self, k_cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) for an FP8 cache, (None, None) for a float one (stored unscaled)."""
        if k_cache.dtype == torch.float8_e4m3fn:
            return self.k_scale, self.v_scale
        return None, None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""
        assert self.backend is not None, "attention backend not set; load the model through engine.loader"
        if not self.backend.capabilities.strided_kv:
            # k, v arrive as views of a fused projection (rows strided). A backend that reads them through
            # their strides (capabilities.strided_kv) saves the copy: one kernel a layer in every compiled step.
            k, v = k.contiguous(), v.contiguous()
        window = self.sliding_window or 0
        k_scale, v_scale = self.kv_scales_for(kv_cache[0])
        if meta.opaque_attention:
            return torch.ops.engine.step_attention(
                q, k, v, kv_cache[0], kv_cache[1], self.scale, window, self.softcap, k_scale, v_scale
            )
        return self.backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            **attention_extras(window, self.softcap, k_scale, v_scale),
        )


def attention_extras(
    window: int, softcap: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
) -> dict[str, Any]:
    """The optional backend arguments a layer uses: a backend without sliding windows, soft-capping or
    FP8 caches is never called with them (the engine keeps such models and caches off it)."""
    extras: dict[str, Any] = {}
    if window:
        extras["window"] = window
    if softcap:
        extras["softcap"] = softcap
    if k_scale is not None:
        extras["k_scale"], extras["v_scale"] = k_scale, v_scale
    return extras
