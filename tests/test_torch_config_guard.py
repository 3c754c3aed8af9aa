"""The suite's guard on torch's global config (tests/torch_config_guard.py) can fail."""

from __future__ import annotations

import os

import pytest
import torch
from torch_config_guard import config_changes, config_snapshot

INNER_TESTS = """
import torch
import torch._dynamo.config


def test_patches_properly():
    with torch._dynamo.config.patch(recompile_limit=3):
        assert torch._dynamo.config.recompile_limit == 3


def test_leaks_a_change():
    torch._dynamo.config.recompile_limit = torch._dynamo.config.recompile_limit + 1


def test_leaks_an_inductor_change():
    torch._inductor.config.max_autotune = not torch._inductor.config.max_autotune
"""


def test_a_test_that_leaves_the_config_changed_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "torch_config_guard", "-q")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        ["*torch._dynamo.config.recompile_limit: * -> *", "*torch._inductor.config.max_autotune*"]
    )


def test_patch_restores_and_the_diff_names_the_entry() -> None:
    before = config_snapshot()
    with torch._dynamo.config.patch(recompile_limit=before["torch._dynamo.config"]["recompile_limit"] + 5):
        inside = config_snapshot()
    assert config_changes(before, config_snapshot()) == []
    assert config_changes(before, inside) == [
        f"torch._dynamo.config.recompile_limit: {before['torch._dynamo.config']['recompile_limit']} -> "
        f"{before['torch._dynamo.config']['recompile_limit'] + 5}"
    ]


def test_the_engines_compile_limits_never_outlive_the_step() -> None:
    from graphs.compiled_step import compile_limits

    before = config_snapshot()
    with compile_limits(1000):
        assert torch._dynamo.config.recompile_limit >= 1000
    assert config_changes(before, config_snapshot()) == []
