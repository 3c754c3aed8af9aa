"""The decode step compiled piecewise: one decoder layer's graph shared by all layers, plus the head.

Every layer has the same shapes and no per-layer Python state, so dynamo
(with nn-module inlining, the default) reuses one compiled layer graph for
all of them: compile cost is one layer's, not the model's (vLLM compiles one
piece per unique layer shape for the same reason). Attention is an opaque
custom op, so the graph never depends on the context length.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata, step_context
from engine.models.interface import CausalLM
from graphs.opaque_attention import attention_context

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger(__name__)


def at_offset_zero(positions: torch.Tensor) -> torch.Tensor:
    """`positions`, copied when it is a view at a storage offset. Dynamo guards on a dynamic tensor's
    storage offset (0 and 1 are specialised), so the decode graphs and the extend step, which share one
    compiled layer graph, must both pass it tensors at offset 0 or compile it again."""
    return positions.clone() if positions.storage_offset() != 0 else positions


class RecompileError(RuntimeError):
    """Something compiled after warm-up: a shape reached the graph that no compiled entry covers."""


class CompileGuard:
    """What compiles around a compiled step's calls once it is warm: counted and logged, or in strict
    mode refused (dynamo's fail_on_recompile stance) with a RecompileError naming the step."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.warm = False  # set once warm-up (or the first compiled call) is over
        self.compiles_after_warmup = 0

    @contextmanager
    def watch(self, what: str, skip_guards: bool = False) -> Iterator[None]:
        """Around one call. skip_guards: once warm, evaluate only the guards that tell entries apart."""
        stance = "fail_on_recompile" if self.strict and self.warm else "default"
        before = compile_count()  # counted around this call only: other engines' compiles don't count
        try:
            with torch.compiler.set_stance(stance, skip_guard_eval_unsafe=skip_guards and self.warm):
                yield
        except RuntimeError as exc:
            if self.strict and "recompil" in str(exc).lower():
                raise RecompileError(f"{what} would recompile after warm-up: {exc}") from exc
            raise
        compiled = compile_count() - before
        if compiled and self.warm:
            self.compiles_after_warmup += compiled
            logger.warning("%s recompiled after warm-up (%d graphs)", what, compiled)


def _layer_step(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    out: torch.Tensor = layer(positions, hidden, (k_cache, v_cache), meta)
    return out


def _head_step(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(hidden)


def compile_count() -> int:
    """Frames dynamo has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_limits(entries: int) -> AbstractContextManager[Any]:
    """dynamo's recompile limits raised to at least `entries` inside the block, restored after it.

    Each capture size is its own compiled entry and dynamo's default limit (8)
    is too low, but torch's config is process-wide: setting it for good would
    change every other torch.compile user in the process. `config.patch`
    restores the old values on exit (and is a few microseconds per step).
    """
    import torch._dynamo

    config: Any = torch._dynamo.config
    names = set(config.get_config_copy())
    changes: dict[str, int] = {}
    for canonical, old in (
        ("recompile_limit", "cache_size_limit"),
        ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
    ):
        name = canonical if canonical in names else old
        if name in names:
            wanted = entries if "accumulated" not in name else 8 * entries
            changes[name] = max(int(getattr(config, name)), wanted)
    patch: AbstractContextManager[Any] = config.patch(changes)
    return patch


_copies = itertools.count()


def private_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The same function under a new code object.

    Dynamo keeps its compiled entries on the code object; a private copy per
    runner keeps one engine's entries (and their guard checks and limits)
    apart from every other engine's in the same process.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compile_piece(
    fn: Callable[..., Any],
    backend: str = "inductor",
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., torch.Tensor]:
    """`fn` torch.compile'd (whole graph) under a private code object: compiled entries of its own."""
    compile_kwargs: dict[str, Any] = {"dynamic": dynamic, "fullgraph": True, "backend": backend}
    if options:
        compile_kwargs["options"] = options
    return torch.compile(private_copy(fn), **compile_kwargs)


def compiled_layer_step(
    backend: str = "inductor", dynamic: bool | None = None, options: dict[str, Any] | None = None
) -> Callable[..., torch.Tensor]:
    """One decoder layer's step (every layer of a kind runs the same compiled graph)."""
    return compile_piece(_layer_step, backend, dynamic, options)


class CompiledDecodeStep:
    """model forward + logits for one decode batch, through the compiled pieces."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: KVCaches,
        dynamic: bool | None = False,
        backend: str = "inductor",
        options: dict[str, Any] | None = None,
        max_entries: int = 8,
        dynamic_batch: bool = False,
        opaque_attention: bool = False,
        layer_fn: Callable[..., torch.Tensor] | None = None,
        compile_head: bool = True,
    ) -> None:
        """dynamic_batch (with dynamic=None): mark the batch dimension dynamic from the first call, so the
        first (largest) capture size compiles the graph every size above 1 shares. Left to dynamo's automatic
        dynamic shapes, the first size compiled a static graph, the second a dynamic one, and size 1 its own:
        three compiles of each piece instead of two. maybe_mark_dynamic: where something in a layer did
        need a fixed batch, dynamo specialises as before instead of failing.
        opaque_attention: the layers call attention as engine::step_attention (graphs/opaque_attention.py),
        so the layer graph takes nothing of the step's metadata and may be shared with the extend step:
        layer_fn, its compiled layer step (callers of one function must agree on this). compile_head:
        False runs the final norm and LM head eagerly (`logits`), one compile fewer."""
        self.model = model
        self.kv_caches = kv_caches
        self.dynamic_batch = dynamic_batch and dynamic is None
        self.max_entries = max_entries  # compiled entries per piece this step may hold (one per capture size)
        self.opaque_attention = opaque_attention
        self.layer_fn: Callable[..., torch.Tensor] = layer_fn or compiled_layer_step(backend, dynamic, options)
        self.head_fn: Callable[..., torch.Tensor] | None = (
            compile_piece(_head_step, backend, dynamic, options) if compile_head else None
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, meta))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The last decoder layer's output for every row."""
        hidden = self.model.embed(input_ids)
        if self.opaque_attention:
            # The static buffers' positions are a row of their staging buffer (one small copy in a captured graph).
            positions = at_offset_zero(positions)
        mark = self.dynamic_batch and input_ids.shape[0] > 1  # size 1 is dynamo's own specialisation anyway
        # Sharing the extend step's layer graph means marking as it does: dynamo guards on which kind of mark
        # a tensor carries, and a graph compiled from weak marks would compile again for the extend step.
        mark_dynamic = torch._dynamo.mark_dynamic if self.opaque_attention else torch._dynamo.maybe_mark_dynamic
        if mark:
            graph_inputs = (
                (positions,)
                if self.opaque_attention
                else (positions, meta.slot_indices, meta.page_table, meta.seq_lens)
            )
            for tensor in graph_inputs:
                mark_dynamic(tensor, 0)
        backend = self.model.attention_backend
        with (
            compile_limits(self.max_entries),
            step_context(backend, meta),
            attention_context(backend, meta) if self.opaque_attention else nullcontext(meta) as layer_meta,
        ):
            tap = self.model.aux_tap
            for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.decoder_layers(), self.kv_caches)):
                if tap is not None:
                    tap.record(index, hidden)
                if mark:
                    mark_dynamic(hidden, 0)
                hidden = self.layer_fn(layer, positions, hidden, k_cache, v_cache, layer_meta)
            if tap is not None:
                tap.record(len(self.kv_caches), hidden)
        if mark and self.head_fn is not None:
            torch._dynamo.maybe_mark_dynamic(hidden, 0)
        return hidden

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head: compiled, or eager into `out` when given (compile_head=False)."""
        if self.head_fn is None:
            return self.model.compute_logits(hidden, out)
        logits = self.head_fn(self.model, hidden)
        return logits if out is None else out.copy_(logits)
