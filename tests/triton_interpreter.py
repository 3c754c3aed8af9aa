"""Running the engine's Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

The CI machines have no GPU; the interpreter runs the same kernel source on
CPU tensors with numpy, so the kernels' logic (ragged blocks, paging, causal
masks, split-K) is tested everywhere; their speed only on the GPU.

Triton 3.6's interpreter turns a loaded scalar into a one-element array and
converts it with int(), which numpy >= 2.3 refuses for arrays that are not
0-d: `range(0, seq_len, BLOCK)` over a loaded length fails. The shim below
converts such one-element arrays explicitly (tests only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import pytest


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _patch_scalar_index() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_engine_scalar_index_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._engine_scalar_index_patched = True


@contextlib.contextmanager
def interpreter_mode() -> Iterator[None]:
    """Kernels run in the interpreter: tests/conftest.py sets TRITON_INTERPRET=1 before triton is
    imported (the mode of triton.language's own helpers is fixed then), so here it is only checked."""
    # Failures, not skips: triton is a test dependency (setup.cfg), and the mode is the conftest's job.
    if not triton_installed():
        pytest.fail("triton is not installed: bash scripts/setup.sh installs the test extra")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail(
            "TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it without a GPU "
            "driver; this machine has a driver but torch sees no CUDA device)"
        )
    _patch_scalar_index()
    yield
