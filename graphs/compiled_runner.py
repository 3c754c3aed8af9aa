"""Compile-based capture (CPU): torch.compile(dynamic=False), one compiled entry per size.

Start-up cost matters on 2 cores, so we compile what repeats once: one
decoder layer's step (every layer has the same shapes and no per-layer Python
state, so dynamo reuses the graph for all of them) plus the final norm + LM
head. Attention is an opaque custom op, so the graph never depends on context
length. Inductor's on-disk FX graph cache makes later starts much faster.
After warm-up any further compilation is a bug: we count recompiles with
dynamo's counters and, in strict mode, raise.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from tqdm import tqdm

from engine.layers.attention import AttentionMetadata, step_context
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from graphs.runner import DecodeGraphRunner

logger = logging.getLogger(__name__)


class RecompileError(RuntimeError):
    """Something compiled after warm-up: a shape reached the graph that no bucket covers."""


def _layer_step(
    layer: DecoderLayer,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    return layer(positions, hidden, (k_cache, v_cache), meta)


def _head_step(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(hidden)


def compile_count() -> int:
    """Frames dynamo has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledDecodeRunner(DecodeGraphRunner):
    def __init__(self, *args: Any, compile_options: dict[str, Any] | None = None, strict: bool = False, skip_guards: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import torch._dynamo

        # Every size is its own entry for each of the two functions; leave room.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(self.capture_sizes) + 8)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(self.capture_sizes) + 8)
        options = dict(compile_options or {})
        backend = options.pop("backend", "inductor")
        self._layer_fn: Callable[..., torch.Tensor] = torch.compile(
            _layer_step, dynamic=False, fullgraph=True, backend=backend, options=options or None
        )
        self._head_fn: Callable[..., torch.Tensor] = torch.compile(
            _head_step, dynamic=False, fullgraph=True, backend=backend, options=options or None
        )
        self.strict = strict
        self.skip_guards = skip_guards
        self.compiles_after_warmup = 0
        self._warm_count: int | None = None

    def _step(self, bs: int) -> torch.Tensor:
        buffers = self.buffers
        meta = buffers.metadata(bs)
        positions = buffers.positions[:bs]
        hidden = self.model.model.embed_tokens(buffers.input_ids[:bs])
        with step_context(self.model.attention_backend, meta):
            for layer, (k_cache, v_cache) in zip(self.model.model.layers, self.kv_caches):
                hidden = self._layer_fn(layer, positions, hidden, k_cache, v_cache, meta)
        return self._head_fn(self.model, hidden)

    def _capture_all(self, sizes_largest_first: list[int]) -> None:
        # Smallest first here: the bs=1 graph is what a single prompt needs soonest,
        # and compile cost does not depend on order on CPU (there is no memory pool).
        for bs in tqdm(sorted(sizes_largest_first), desc="Compiling decode (cpu)", unit="size", disable=None):
            self.buffers.seq_lens[:bs].fill_(1)
            self.buffers.slot_indices[:bs].zero_()
            self.buffers.page_table[:bs].zero_()
            with torch.no_grad():
                for _ in range(2):
                    self._step(bs)
        self._warm_count = compile_count()

    def _replay(self, bs: int) -> torch.Tensor:
        # After warm-up only the guards that tell the sizes apart are evaluated
        # (every entry was compiled for these exact inputs); in strict mode a
        # recompile raises instead of silently compiling on the serving path.
        stance = "fail_on_recompile" if self.strict else "default"
        try:
            with torch.no_grad(), torch.compiler.set_stance(stance, skip_guard_eval_unsafe=self.skip_guards):
                logits = self._step(bs)
        except RuntimeError as exc:
            if self.strict and "recompil" in str(exc).lower():
                raise RecompileError(f"decode graph would recompile after warm-up at batch size {bs}: {exc}") from exc
            raise
        if self._warm_count is not None:
            now = compile_count()
            if now != self._warm_count:
                self.compiles_after_warmup += now - self._warm_count
                self._warm_count = now
                message = f"decode graph recompiled after warm-up at batch size {bs}"
                if self.strict:
                    raise RecompileError(message)
                logger.warning(message)
        return logits
