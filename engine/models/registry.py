"""Which model class serves which checkpoint: HF `model_type` (and `architectures`) -> family class.

Each family module registers its class with `@register_model(...)`;
engine/models/families.py imports every family, and every lookup here
imports it first, so a lookup sees them all. This module imports no
model code, so configs can ask what is supported without building anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from engine.models.interface import CausalLM

T = TypeVar("T", bound="type[CausalLM]")

_BY_MODEL_TYPE: dict[str, type[CausalLM]] = {}
_BY_ARCHITECTURE: dict[str, type[CausalLM]] = {}


def register_model(*model_types: str, architectures: tuple[str, ...] = ()) -> Callable[[T], T]:
    """Class decorator: this class runs checkpoints of these model types (and HF architecture names)."""

    def register(cls: T) -> T:
        for model_type in model_types:
            if model_type in _BY_MODEL_TYPE and _BY_MODEL_TYPE[model_type] is not cls:
                raise ValueError(
                    f"model_type {model_type!r} is registered twice "
                    f"({_BY_MODEL_TYPE[model_type].__name__}, {cls.__name__})"
                )
            _BY_MODEL_TYPE[model_type] = cls
        for architecture in architectures:
            _BY_ARCHITECTURE[architecture] = cls
        return cls

    return register


def _families_loaded() -> None:
    import engine.models.families  # noqa: F401  (registers every family)


def supported_model_types() -> list[str]:
    _families_loaded()
    return sorted(_BY_MODEL_TYPE)


def model_class_for_type(model_type: str | None, architectures: list[str] | None = None) -> type[CausalLM] | None:
    """The class for a checkpoint: by model_type, else by one of its architectures; None if neither."""
    _families_loaded()
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for architecture in architectures or []:
        if architecture in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[architecture]
    return None
