"""The LM head's row counts outside the graphs, held to a fixed ladder.

Extend and mixed steps run the LM head eagerly over their sampled rows, a count that changes from step to
step. On the H200, cuBLAS's first matmul of a new row count against the 128k-row head (a kernel not used
before) blocks the host until the device has run everything queued: ~130-270 ms in a mixed step of the
offline run, which left the device idle while the host then built and launched the next step
(benchmarks/logit_rows_block.py reproduces it; a row count run before returns at once). Padding the rows to a
ladder of sizes and running each size once at start-up pays those first uses before any request.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class LogitRowLadder:
    """Row counts the LM head runs at; a step's sampled rows are padded with zero rows up to the next one."""

    def __init__(self, sizes: Sequence[int], max_rows: int) -> None:
        """sizes: the decode capture sizes; max_rows: max_num_seqs. Past the largest size below max_rows the
        ladder goes on in steps of its last gap (512 + 64k up to 1,024 running requests), not one jump."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        below = sorted({int(s) for s in sizes if 0 < int(s) < max_rows})
        step = below[-1] - below[-2] if len(below) >= 2 else max(below[-1] if below else max_rows, 1)
        above = range(below[-1] + step, max_rows, step) if below else range(0)
        self.sizes = below + list(above) + [int(max_rows)]

    def padded_rows(self, rows: int) -> int:
        """The ladder's size for `rows` rows; past the top (prompt logprobs' slices), `rows` itself."""
        at = bisect.bisect_left(self.sizes, rows)
        return self.sizes[at] if at < len(self.sizes) else rows

    def logits(self, compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits over `hidden` padded to the ladder; the logits of its own rows."""
        rows = hidden.shape[0]
        padding = self.padded_rows(rows) - rows
        if padding == 0:
            return compute_logits(hidden)
        return compute_logits(F.pad(hidden, (0, 0, 0, padding)))[:rows]

    def warm(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        synchronize: Callable[[], None],
    ) -> float:
        """Run the LM head once at every size (largest first); seconds taken."""
        start = time.perf_counter()
        with torch.no_grad():
            for rows in reversed(self.sizes):
                compute_logits(torch.zeros(rows, hidden_size, dtype=dtype, device=device))
        synchronize()
        seconds = time.perf_counter() - start
        logger.info(
            "LM head warmed at %d row counts (%d..%d) in %.2f s: extend and mixed steps pad their sampled "
            "rows to these",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            seconds,
        )
        return seconds
