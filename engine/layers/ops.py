"""Registering the engine's opaque operators (attention, packed linear) with torch.

torch.library.custom_op wraps every call in several Python layers (autograd,
alias checks, redispatch): ~20 us per call on this CPU, or ~3 ms a SmolLM2
decode step at 5 calls x 30 layers. A plain Library definition dispatches in
~4 us. The compiler sees the same thing either way: an opaque op with a
schema (mutations marked with `!`) and a fake implementation for shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("engine", "FRAGMENT")

# Every backend's decode-attention op stores this step's k/v at slot_indices (mutating the
# caches) and attends over the page table: one schema, so backends stay interchangeable.
# window: a sliding window (each query sees its last `window` positions); 0 for none.
# softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); 0 for none.
DECODE_ATTENTION_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_indices, "
    "Tensor page_table, Tensor seq_lens, int page_size, float scale, int window=0, float softcap=0.0) -> Tensor"
)


def decode_attention_fake(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Shapes only: the output is q's, whatever trailing arguments a backend adds (Triton's KV scales)."""
    return torch.empty_like(q)


def define_decode_attention_op(name: str, impl: Callable[..., torch.Tensor]) -> None:
    """engine::<name> with the shared decode-attention schema."""
    define_op(name, DECODE_ATTENTION_SCHEMA, impl, decode_attention_fake)


def define_op(name: str, schema: str, impl: Callable[..., object], fake: Callable[..., object]) -> None:
    """engine::<name>(<schema>) implemented by `impl` on every device, `fake` for tracing. An op that writes
    into an argument marks it in the schema (`Tensor(a!) out`); one that only does so returns `()` and its impl
    and fake None. Under torch.compile, inductor then runs it on the argument's own buffer when nothing reads
    the old values afterwards, and on a copy when something does."""
    _LIBRARY.define(f"{name}{schema}")
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"engine::{name}", fake, lib=_LIBRARY)
