"""argparse flags made from settings dataclasses (engine/setting.py): each flag comes from its field.

The flag's type follows the field's annotation (bool: a switch; `bool | None`: --x / --no-x, unset when
not given; int, float, str: a value), its help, spellings, choices and parser from the field's FlagSpec.
A device section's flags (--hpu-graph-mode: `section="hpu"`) are all unset by default, so that only what
the command line names overrides the device YAML.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field
from typing import TYPE_CHECKING, Any

from engine.setting import FlagSpec, described_fields

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def _value_types(cls: type[DataclassInstance], name: str) -> tuple[object, ...]:
    """The field's annotation as a tuple of types, None left out (`int | None` -> (int,))."""
    hint = typing.get_type_hints(cls)[name]
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(m for m in members if m is not type(None))


def _default(f: Field[Any]) -> object:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def dest_of(name: str, section: str | None) -> str:
    return name if section is None else f"{section}__{name}"


def _names(name: str, spec: FlagSpec, section: str | None) -> tuple[str, ...]:
    if spec.names and section is None:
        return spec.names
    prefix = "" if section is None else f"{section}-"
    return (f"--{prefix}{name.replace('_', '-')}",)


def add_setting_flags(
    group: argparse._ArgumentGroup | argparse.ArgumentParser,
    cls: type[DataclassInstance],
    section: str | None = None,
    placeholders: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of `cls` that is on the command line; `placeholders` fill {name} in help texts."""
    for f, spec in described_fields(cls):
        if not spec.on_command_line:
            continue
        help_text = spec.help.replace("%", "%%")  # argparse formats help with %
        for key, value in (placeholders or {}).items():
            help_text = help_text.replace("{" + key + "}", value)
        dest = dest_of(f.name, section)
        default = None if section is not None else _default(f)
        names = _names(f.name, spec, section)
        kinds = _value_types(cls, f.name)
        options: dict[str, Any] = {"dest": dest, "help": help_text, "default": default}
        if spec.metavar is not None:
            options["metavar"] = spec.metavar
        if kinds == (bool,):
            if default is False:
                group.add_argument(*names, action="store_true", **options)
            else:
                group.add_argument(*names, action=argparse.BooleanOptionalAction, **options)
            if spec.off_names:
                group.add_argument(*spec.off_names, dest=dest, action="store_false", help=f"off: {help_text}")
            continue
        if spec.choices is not None:
            options["choices"] = spec.choices
        options.setdefault("metavar", None if spec.choices is not None else f.name.upper())
        parse = spec.parse or next((k for k in kinds if k in (int, float)), str)
        group.add_argument(*names, type=parse, **options)


def values_from_args(
    args: argparse.Namespace, cls: type[DataclassInstance], section: str | None = None
) -> dict[str, Any]:
    """The values of `cls`'s command-line fields in parsed args; a section's only where the flag was given."""
    values: dict[str, Any] = {}
    for f, spec in described_fields(cls):
        if not spec.on_command_line:
            continue
        value = getattr(args, dest_of(f.name, section))
        if section is None or value is not None:
            values[f.name] = value
    return values
