"""One definition per setting: a dataclass field whose metadata carries its command-line flag.

`EngineConfig` (engine/config.py) and a platform's own section (backends/hpu/settings.py) declare each
setting once, with `setting(default, help)`; engine/cli_flags.py makes the argparse flags from those
fields, so a flag is never written by hand beside the field it sets, and a new field gets its flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")

FLAG_KEY = "flag"  # the key of a field's metadata that holds its FlagSpec


@dataclass(frozen=True)
class FlagSpec:
    """How a field appears on the command line (its type comes from the field's annotation)."""

    help: str
    names: tuple[str, ...] = ()  # the flag's spellings; default: --<field-name> with '-' for '_'
    # Flags that set a bool field to False (e.g. --disable-prefix-caching for enable_prefix_caching).
    off_names: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], object] | None = None  # text to value, where the annotation's type does not say
    on_command_line: bool = True  # False: set by code or YAML only (the device YAML the engine read)


def setting(
    default: T,
    help: str,
    *,
    names: tuple[str, ...] = (),
    off_names: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], object] | None = None,
    on_command_line: bool = True,
) -> T:
    """A dataclass field with its default and its command-line flag's definition."""
    spec = FlagSpec(help, names, off_names, choices, metavar, parse, on_command_line)
    return field(default=default, metadata={FLAG_KEY: spec})


def setting_factory(
    factory: Callable[[], T],
    help: str,
    *,
    parse: Callable[[str], object] | None = None,
    on_command_line: bool = False,
) -> T:
    """setting() for a mutable default (a dict), built fresh for every instance."""
    spec = FlagSpec(help, parse=parse, on_command_line=on_command_line)
    return field(default_factory=factory, metadata={FLAG_KEY: spec})


def flag_spec(f: Field[Any]) -> FlagSpec:
    """The field's FlagSpec; a field declared without setting() is a programming error, named here."""
    spec = f.metadata.get(FLAG_KEY)
    if not isinstance(spec, FlagSpec):
        raise TypeError(f"field {f.name!r} is not declared with engine.setting.setting(): it has no flag definition")
    return spec


def described_fields(cls: type[DataclassInstance]) -> list[tuple[Field[Any], FlagSpec]]:
    """Every field of a settings dataclass with its FlagSpec, in declaration order."""
    return [(f, flag_spec(f)) for f in fields(cls)]
