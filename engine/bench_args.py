"""Flag names of the `engine bench` subcommands, spelled as vLLM's and SGLang's benchmark scripts spell them.

Where a subcommand has the concept, it takes the name those scripts use: --num-prompts, --input-len,
--output-len, --max-concurrency, --request-rate, --dataset-name, --seed, --output-json. A name the engine
used before (--num-requests, --concurrency, --token-ids, --output) is kept for a while as a hidden alias:
it still works, is left out of --help, and says on stderr which name replaces it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class _OldName(argparse.Action):
    """A flag's old name: stores under the new flag's dest, and says on stderr which name replaces it."""

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        new_name: str,
        default: Any = None,  # argparse passes its own; an alias never sets a default
        help: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new_name = new_name

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is an old name, use {self.new_name}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_renamed(group: Any, name: str, *old_names: str, **kwargs: Any) -> argparse.Action:
    """`group.add_argument(name, **kwargs)` (a parser or an argument group), and each of old_names as a hidden
    alias that takes a value the same way and stores it in the same place."""
    action = group.add_argument(name, **kwargs)
    for old in old_names:
        group.add_argument(
            old,
            dest=action.dest,
            action=_OldName,
            new_name=name,
            type=action.type,
            choices=action.choices,
            metavar=action.metavar,
        )
    return action


def add_old_switch(group: Any, old: str, dest: str, value: Any, replacement: str) -> None:
    """A hidden switch of old that stands for a value of a new flag (e.g. --token-ids: --dataset-name random)."""
    group.add_argument(old, dest=dest, action=_OldName, new_name=replacement, nargs=0, const=value)
