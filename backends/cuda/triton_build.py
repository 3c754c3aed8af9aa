"""Loading Triton kernels lazily, and knowing whether they run compiled or interpreted.

Kernel sources live in backends/cuda/kernels/, as module-level functions
(Triton resolves the helpers a kernel calls among its module's globals), and
are imported only on first use, so `import backends` needs no Triton.
With TRITON_INTERPRET=1 (the CPU tests, set before triton is imported) the
same source runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any


def interpreted() -> bool:
    """Kernels run in Triton's interpreter (CPU tests), not compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def load_kernel(module_name: str, name: str) -> Any:
    """The kernel `name` of a module under backends/cuda/kernels/, imported on first use."""
    return getattr(importlib.import_module(module_name), name)
