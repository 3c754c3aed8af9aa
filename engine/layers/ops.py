"""Registering the engine's opaque operators (attention, packed linear) with torch.

torch.library.custom_op wraps every call in several Python layers (autograd,
alias checks, redispatch): ~20 us per call on this CPU, or ~3 ms a SmolLM2
decode step at 5 calls x 30 layers. A plain Library definition dispatches in
~4 us. The compiler sees the same thing either way: an opaque op with a
schema (mutations marked with `!`) and a fake implementation for shapes.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIBRARY = torch.library.Library("engine", "FRAGMENT")


def define_op(name: str, schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> None:
    """engine::<name>(<schema>) implemented by `impl` on every device, `fake` for tracing."""
    _LIBRARY.define(f"{name}{schema}")
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"engine::{name}", fake, lib=_LIBRARY)
