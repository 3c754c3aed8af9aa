"""Prefill, chunk and mixed steps compiled piecewise, with the token count as one dynamic dimension.

An eager step of Llama-3-8B launches ~1,400 kernels, which costs the host
~26 ms whatever the step's size: a mixed step that carries a short prompt
along with 200 decodes ran at the host's speed, not the GPU's. Compiled
(inductor fuses the norms, rotary, activations and residual adds), a layer
launches ~10 kernels. As in the decode step (graphs/compiled_step.py) one
layer graph serves every layer; here the token dimension is marked dynamic,
so one graph serves every step size too (dynamo specialises 1 token apart).

Attention is the one opaque piece, `engine::step_attention`
(graphs/opaque_attention.py), which finds the step's metadata at run time:
the graph never guards on the batch's composition (how many requests, how
long each is, how many decode rows), so nothing recompiles from step to step.
On CUDA the decode graphs are captured from this same layer graph (`layer_fn`,
compiled at the largest decode size): the first extend step compiles nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

import torch

from engine.layers.attention import AttentionMetadata, step_context
from engine.models.interface import CausalLM
from graphs.compile_report import compile_report
from graphs.compiled_step import (
    CompileGuard,
    KVCaches,
    at_offset_zero,
    compile_count,
    compile_limits,
    compiled_layer_step,
)
from graphs.opaque_attention import attention_context
from graphs.step_runner import StepInputs, StepResult, StepRunner

logger = logging.getLogger(__name__)


class CompiledExtendStep:
    """model forward (hidden states of every token) for extend and mixed steps, through compiled layers.

    One compile, on the first step of two or more tokens, unless the decode graphs compiled `layer_fn`
    already; a one-token extend (a prompt cached up to its last token) runs eagerly, since dynamo would
    give size 1 an entry of its own. In strict mode anything that would compile after that raises;
    otherwise it is counted and logged.
    """

    def __init__(self, model: CausalLM, kv_caches: KVCaches, backend: str = "inductor", strict: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        # Shared with the CUDA decode graphs (Engine.graph_runner_options), which compile it first.
        self.layer_fn: Callable[..., torch.Tensor] = compiled_layer_step(backend)
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
        hidden = self.model.embed(input_ids)
        positions = at_offset_zero(positions)  # a decode step's positions are a row of its stacked inputs
        # The token count is dynamic from the first call on: no step size ever compiles again.
        torch._dynamo.mark_dynamic(hidden, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        before = compile_count()
        # One entry per layer kind (full / sliding attention, dense / MoE MLP), plus room for dynamo.
        with (
            compile_limits(8),
            self.guard.watch(f"extend step of {input_ids.shape[0]} tokens"),
            step_context(backend, meta),
            attention_context(backend, meta) as layer_meta,
            compile_report() if not self.guard.warm else nullcontext() as compiled,
        ):
            tap = self.model.aux_tap
            for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.decoder_layers(), self.kv_caches)):
                if tap is not None:
                    tap.record(index, hidden)
                hidden = self.layer_fn(layer, positions, hidden, k_cache, v_cache, layer_meta)
            if tap is not None:
                tap.record(len(self.kv_caches), hidden)
        if compiled is not None:  # the first call: not warm
            graphs = compile_count() - before
            if graphs:
                logger.info(
                    "compiled the extend step's layer graph (token count dynamic, %d graphs) on a %d-token step; %s",
                    graphs,
                    input_ids.shape[0],
                    compiled.summary(),
                )
            else:
                logger.info(
                    "extend steps run the layer graph compiled for the decode graphs (nothing compiled on the "
                    "first, %d-token step)",
                    input_ids.shape[0],
                )
            self.guard.warm = True
        return hidden


class CompiledStepRunner(StepRunner):
    """Every step through the compiled layers (token count dynamic): extend and mixed steps, and decode steps
    past the largest decode graph (vLLM's piecewise mode past its capture sizes: the layer graph is token-count
    dynamic and attention opaque, so such a step compiles nothing new)."""

    name = "compiled layers"

    def __init__(self, step: CompiledExtendStep) -> None:
        self.step = step

    def can_run(self, inputs: StepInputs) -> bool:
        return True

    def run(self, inputs: StepInputs) -> StepResult:
        batch = inputs.batch()
        return StepResult(hidden=self.step(batch.input_ids, batch.positions, batch.meta))
