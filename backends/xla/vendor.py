"""The vendor modules (torchax, jax), imported once and lazily, behind a torch-2.13 compatibility shim.

torchax 0.0.13 keys its op tables by named-tensor (`Dimname`) overloads, e.g. `aten.prod.dim_Dimname`, that
torch 2.13 removed, so a plain `import torchax` fails with
`AttributeError: The underlying op of 'aten.prod' has no overload name 'dim_Dimname'`. Those overloads are
never called (the engine has no named tensors); they only key the tables. While torchax imports and builds
its environment (which loads its op tables, decompositions included), a lookup of a missing `*imname*`
overload returns an inert placeholder; the lookup is restored right after.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from engine.platform import DeviceUnavailableError

logger = logging.getLogger(__name__)

# The versions this backend ran with (docs/xla.md); .ci/run installs the same.
TORCHAX_VERSION = "0.0.13"
JAX_VERSION = "0.10.2"
INSTALL_COMMAND = f"pip install torchax=={TORCHAX_VERSION} 'jax[cpu]=={JAX_VERSION}'"


@dataclass(frozen=True)
class Vendor:
    """The imported modules the backend uses."""

    jax: ModuleType
    jnp: ModuleType
    torchax: ModuleType
    interop: ModuleType
    mappings: ModuleType


class _MissingOverload:
    """Stands in for a removed Dimname overload in torchax's tables; never called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<overload {self.name} removed from torch>"


def missing_modules() -> list[str]:
    """The vendor modules this environment lacks (empty: the backend can load)."""
    return [name for name in ("jax", "torchax") if importlib.util.find_spec(name) is None]


def is_dimname_overload(key: str) -> bool:
    """Whether an overload name is one of the named-tensor overloads torch 2.13 removed (the shim's only target)."""
    return "imname" in key or "names" in key  # dim_Dimname, dimname, names_ScalarOpt_dim, correction_names, ...


def import_torchax_with_shim() -> ModuleType:
    """`import torchax` and its default environment (the op tables), answering removed Dimname overload lookups
    with a placeholder meanwhile."""
    import torch._ops as ops

    original = ops.OpOverloadPacket.__getattr__
    shimmed: list[str] = []

    def lookup(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if not is_dimname_overload(key):
                raise
            shimmed.append(f"{self._qualified_op_name}.{key}")
            return _MissingOverload(key)

    ops.OpOverloadPacket.__getattr__ = lookup  # type: ignore[method-assign]
    try:
        import torchax

        torchax.default_env()  # loads the op tables and decompositions, which name more removed overloads
    finally:
        ops.OpOverloadPacket.__getattr__ = original  # type: ignore[method-assign]
    if shimmed:
        logger.debug("torchax: %d removed Dimname overloads shimmed: %s", len(shimmed), ", ".join(shimmed))
    return torchax  # type: ignore[no-any-return]


@functools.cache
def load() -> Vendor:
    """The vendor modules, or DeviceUnavailableError naming the install command."""
    missing = missing_modules()
    if missing:
        raise DeviceUnavailableError(
            f"--device xla needs {' and '.join(missing)}, not installed here; install them with: {INSTALL_COMMAND}"
        )
    import jax
    import jax.numpy as jnp

    torchax = import_torchax_with_shim()
    import torchax.interop as interop
    import torchax.ops.mappings as mappings

    return Vendor(jax=jax, jnp=jnp, torchax=torchax, interop=interop, mappings=mappings)
