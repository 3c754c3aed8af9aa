"""A pytest plugin: a test that leaves torch's dynamo or inductor config changed fails.

torch's config modules are process-wide, and `monkeypatch.setattr` on them is
unsafe (with pytest 9 and torch 2.13 its undo hid `cache_size_limit` for the
rest of the process, failing seven unrelated tests later on). Tests change
them through `torch._dynamo.config.patch(...)`; this guard catches whatever
slips through, in the test that did it rather than in a later victim.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def config_snapshot() -> dict[str, dict[str, Any]]:
    import torch._dynamo.config
    import torch._inductor.config

    return {
        "torch._dynamo.config": torch._dynamo.config.get_config_copy(),
        "torch._inductor.config": torch._inductor.config.get_config_copy(),
    }


def config_changes(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """'module.name: old -> new' for every entry that differs (or appeared, or vanished)."""
    changes = []
    for module, old in before.items():
        new = after.get(module, {})
        for name in sorted(set(old) | set(new)):
            missing = "<missing>"
            if old.get(name, missing) != new.get(name, missing):
                changes.append(f"{module}.{name}: {old.get(name, missing)!r} -> {new.get(name, missing)!r}")
    return changes


@pytest.fixture(autouse=True)
def _torch_config_unchanged() -> Iterator[None]:
    before = config_snapshot()
    yield
    changes = config_changes(before, config_snapshot())
    if changes:
        pytest.fail(
            "test left torch's global config changed (use config.patch): " + "; ".join(changes[:5]), pytrace=False
        )
