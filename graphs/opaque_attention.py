"""Attention as one opaque op whose metadata is found at run time, not passed through the graph.

`engine::step_attention` takes only the layer's tensors (q, k, v, the caches,
FP8 scales); its implementation finds the step's backend and metadata (page
table, lengths, ragged offsets on the host) in a per-thread context entered
around the forward pass, as vLLM's forward context does. A compiled layer
graph that calls it therefore never guards on, or takes as inputs, anything
about the batch's composition: the same graph serves a decode step of any
batch size and an extend or mixed step of any token count. The CUDA runner
compiles one layer graph for both (graphs/compiled_extend.py,
graphs/cuda_graph_runner.py), where two compiles cost a cold start ~2 s more.
Under a CUDA graph the op runs only while capturing; a replay launches the
kernels it launched then, reading the static buffers it was given.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from engine.layers.attention import AttentionMetadata, attention_extras
from engine.layers.ops import define_op

_context = threading.local()  # per thread: two engines in two threads never see each other's step


@contextmanager
def attention_context(backend: Any, meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make this step's backend and metadata visible to every layer's step_attention call; yields the
    metadata the layers get, marked so that they call the op (engine.layers.attention.Attention)."""
    previous = getattr(_context, "current", None)
    _context.current = (backend, meta)
    try:
        yield replace(meta, opaque_attention=True)
    finally:
        _context.current = previous


def _step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    current = getattr(_context, "current", None)
    if current is None:
        raise RuntimeError("engine::step_attention called outside attention_context (no step metadata)")
    backend, meta = current  # the step's own metadata, unmarked: the backend runs attention itself
    out: torch.Tensor = backend.forward(
        q, k, v, k_cache, v_cache, meta, scale, **attention_extras(window, softcap, k_scale, v_scale)
    )
    return out


def _step_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q)


define_op(
    "step_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, float scale, int window=0, "
    "float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
    _step_attention,
    _step_attention_fake,
)
