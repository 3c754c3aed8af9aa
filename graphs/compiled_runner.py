"""Compile-based capture (CPU): torch.compile(dynamic=False), one compiled entry per size.

Start-up cost matters on 2 cores, so the step is compiled piecewise
(graphs/compiled_step.py: one layer graph shared by every layer, plus the
head) and inductor's on-disk FX graph cache makes later starts much faster.
After warm-up any further compilation is a bug: we count compiles with
dynamo's counters and, in strict mode, raise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from graphs.compiled_step import CompiledDecodeStep, CompileGuard, RecompileError, compile_count
from graphs.step_runner import DecodeGraphRunner

logger = logging.getLogger(__name__)

__all__ = ["CompiledDecodeRunner", "RecompileError", "compile_count"]


class CompiledDecodeRunner(DecodeGraphRunner):
    capture_what = "compiled decode sizes (cpu)"
    # Smallest first: the bs=1 entry is what a single prompt needs soonest, and on CPU there is no memory
    # pool that would favour largest first.
    capture_largest_first = False

    def __init__(
        self,
        *args: Any,
        compile_options: dict[str, Any] | None = None,
        strict: bool = False,
        skip_guards: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        options = dict(compile_options or {})
        backend = options.pop("backend", "inductor")
        # One entry per size in each piece (layer, head), plus slack.
        self.step = CompiledDecodeStep(
            self.model,
            self.kv_caches,
            dynamic=False,
            backend=backend,
            options=options,
            max_entries=2 * len(self.capture_sizes) + 8,
        )
        self.skip_guards = skip_guards
        self.guard = CompileGuard(strict)

    @property
    def compiles_after_warmup(self) -> int:
        return self.guard.compiles_after_warmup

    def _run_size(self, bs: int) -> torch.Tensor:
        buffers = self.buffers
        return self.step(buffers.input_ids[:bs], buffers.positions[:bs], self.capture_metadata(bs))

    def capture(self, sizes: list[int] | None = None) -> None:
        super().capture(sizes)
        self.guard.warm = True  # from now on a compile is a recompile (CompileGuard)

    def _capture_size(self, bs: int) -> None:
        self.hooks.prepare_for_capture(self.buffers, bs)
        with torch.no_grad():
            for _ in range(2):
                self._run_size(bs)
        self.hooks.after_capture(self.buffers, bs, None)  # no graph object: the compiled entries

    def _replay(self, bs: int) -> torch.Tensor:
        # After warm-up only the guards that tell the sizes apart are evaluated
        # (every entry was compiled for these exact inputs); in strict mode a
        # recompile raises instead of silently compiling on the serving path.
        self.hooks.before_replay(self.buffers, bs, None)
        with torch.no_grad(), self.guard.watch(f"decode graph at batch size {bs}", skip_guards=self.skip_guards):
            return self._run_size(bs)
