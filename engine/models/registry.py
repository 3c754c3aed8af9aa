"""Which family serves which checkpoint: HF `model_type` (else one of its `architectures`), or a GGUF
file's `general.architecture` -> the Family its file in engine/models/families/ declares.

The families are found, not listed: on the first lookup every module of that package is imported and
its `FAMILY` read. This module imports no model code itself, so configs can ask what is supported
without building anything.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import engine.models.families as family_package
from engine.models.family import Family

if TYPE_CHECKING:
    from engine.models.interface import CausalLM


@dataclass
class _Index:
    families: list[Family] = field(default_factory=list)
    by_model_type: dict[str, Family] = field(default_factory=dict)
    by_architecture: dict[str, Family] = field(default_factory=dict)
    by_gguf_arch: dict[str, Family] = field(default_factory=dict)

    def add(self, family: Family, module: str) -> None:
        """Index one family; a name two families claim is a mistake in one of their files."""
        keys = [
            (self.by_model_type, family.model_types, "model_type"),
            (self.by_architecture, family.architectures, "architecture"),
        ]
        if family.gguf is not None:
            keys.append((self.by_gguf_arch, family.gguf.archs, "GGUF architecture"))
        for table, names, what in keys:
            for name in names:
                if name in table:
                    raise ValueError(
                        f"{what} {name!r} is claimed by families {table[name].name!r} and {family.name!r} ({module})"
                    )
                table[name] = family
        self.families.append(family)


@functools.cache
def _index() -> _Index:
    index = _Index()
    for module_info in sorted(pkgutil.iter_modules(family_package.__path__), key=lambda m: m.name):
        name = f"{family_package.__name__}.{module_info.name}"
        family = getattr(importlib.import_module(name), "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{name} defines no FAMILY (engine.models.family.Family): every module there is one family")
        if family.name != module_info.name:
            raise ValueError(f"{name} declares family {family.name!r}: a family is named after its file")
        index.add(family, name)
    return index


def families() -> list[Family]:
    """Every family, in the order of their files' names."""
    return list(_index().families)


def family_for(model_type: str | None, architectures: list[str] | None = None) -> Family | None:
    """The family of a checkpoint: by model_type, else by one of its architectures; None if neither."""
    index = _index()
    if model_type in index.by_model_type:
        return index.by_model_type[model_type]
    for architecture in architectures or []:
        if architecture in index.by_architecture:
            return index.by_architecture[architecture]
    return None


def family_for_gguf_arch(arch: str) -> Family | None:
    """The family whose GGUFSpec names this `general.architecture`; None if no family reads it."""
    return _index().by_gguf_arch.get(arch)


def supported_model_types() -> list[str]:
    return sorted(_index().by_model_type)


def model_class_for_type(model_type: str | None, architectures: list[str] | None = None) -> type[CausalLM] | None:
    """The class for a checkpoint (family_for's, by model_type then architectures); None if no family serves it."""
    family = family_for(model_type, architectures)
    return None if family is None else family.model_class
