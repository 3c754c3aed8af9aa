"""Prefill, chunk and mixed steps compiled piecewise, with the token count as one dynamic dimension.

An eager step of Llama-3-8B launches ~1,400 kernels, which costs the host
~26 ms whatever the step's size: a mixed step that carries a short prompt
along with 200 decodes ran at the host's speed, not the GPU's. Compiled
(inductor fuses the norms, rotary, activations and residual adds), a layer
launches ~10 kernels. As in the decode step (graphs/compiled_step.py) one
layer graph serves every layer; here the token dimension is marked dynamic,
so one graph serves every step size too (dynamo specialises 1 token apart).

Attention is the one opaque piece: `engine::extend_attention` takes only
tensors, and its implementation finds the step's metadata (ragged offsets,
page table, lengths on the host) in a per-thread context entered around the
forward pass, as vLLM's forward context does. The graph therefore never
guards on the batch's composition (how many requests, how long each is,
how many decode rows): nothing about it recompiles from step to step.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from engine.layers.attention import AttentionMetadata, attention_extras, step_context
from engine.layers.ops import define_op
from engine.models.interface import CausalLM
from graphs.compile_report import compile_report
from graphs.compiled_step import CompileGuard, KVCaches, _layer_step, compile_count, compile_limits, private_copy

logger = logging.getLogger(__name__)

_context = threading.local()  # per thread: two engines in two threads never see each other's step


@contextmanager
def extend_context(backend: Any, meta: AttentionMetadata) -> Iterator[None]:
    """Make this step's backend and metadata visible to every layer's extend_attention call."""
    previous = getattr(_context, "current", None)
    _context.current = (backend, meta)
    try:
        yield
    finally:
        _context.current = previous


def _extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
    window: int = 0, softcap: float = 0.0, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    current = getattr(_context, "current", None)
    if current is None:
        raise RuntimeError("engine::extend_attention called outside extend_context (no step metadata)")
    backend, meta = current
    meta = replace(meta, opaque_extend=False)
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale, **attention_extras(window, softcap, k_scale, v_scale))


def _extend_attention_fake(q, k, v, k_cache, v_cache, scale, window=0, softcap=0.0, k_scale=None, v_scale=None):  # noqa: ANN001, ANN202
    return torch.empty_like(q)


define_op(
    "extend_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, float scale, int window=0, float softcap=0.0, "
    "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
    _extend_attention,
    _extend_attention_fake,
)


class CompiledExtendStep:
    """model forward (hidden states of every token) for extend and mixed steps, through compiled layers.

    One compile, on the first step of two or more tokens; a one-token extend (a prompt cached up
    to its last token) runs eagerly, since dynamo would give size 1 an entry of its own. In strict
    mode anything that would compile after that raises; otherwise it is counted and logged.
    """

    def __init__(self, model: CausalLM, kv_caches: KVCaches, backend: str = "inductor", strict: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layer_fn: Callable[..., torch.Tensor] = torch.compile(
            private_copy(_layer_step), dynamic=None, fullgraph=True, backend=backend
        )
        self.guard = CompileGuard(strict)  # warm once the first compiled step has run
        self.eager_steps = 0

    @property
    def compiled(self) -> bool:
        return self.guard.warm

    @property
    def compiles_after_first(self) -> int:
        return self.guard.compiles_after_warmup

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        backend = self.model.attention_backend
        if input_ids.shape[0] < 2:
            self.eager_steps += 1
            with step_context(backend, meta):
                return self.model(input_ids, positions, self.kv_caches, meta)
        meta = replace(meta, opaque_extend=True)  # the layers call engine::extend_attention
        hidden = self.model.embed(input_ids)
        # The token count is dynamic from the first call on: no step size ever compiles again.
        torch._dynamo.mark_dynamic(hidden, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        before = compile_count()
        # One entry per layer kind (full / sliding attention, dense / MoE MLP), plus room for dynamo.
        with compile_limits(8), self.guard.watch(f"extend step of {input_ids.shape[0]} tokens"), \
                step_context(backend, meta), extend_context(backend, meta), \
                (compile_report() if not self.guard.warm else nullcontext()) as compiled:
            for layer, (k_cache, v_cache) in zip(self.model.decoder_layers(), self.kv_caches):
                hidden = self.layer_fn(layer, positions, hidden, k_cache, v_cache, meta)
        if not self.guard.warm:
            logger.info("compiled the extend step's layer graph (token count dynamic, %d graphs) on a %d-token step; %s",
                        compile_count() - before, input_ids.shape[0], compiled.summary())
            self.guard.warm = True
        return hidden
