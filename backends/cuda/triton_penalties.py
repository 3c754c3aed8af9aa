"""Repetition, frequency and presence penalties for a whole batch in one Triton launch (CUDA/ROCm).

The torch path (engine/sampler.py) gathers each penalized request's seen/counts
rows into new [n, vocab] tensors and makes about a dozen full-vocabulary passes
(comparisons, divisions, two where()s): ~0.4 ms at batch 256 over a 128k
vocabulary on an H200. This kernel reads each logits row, its seen (and counts)
row where they live, and writes the logits back in place: three passes' worth
of bytes.
"""

from __future__ import annotations

import torch

from backends.cuda.triton_build import load_kernel

BLOCK = 4096


def apply_penalties_(
    logits: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor | None,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalize logits [batch, vocab] in place: rows positions[i] with decode-row state rows[i] and the
    i-th penalties (float32). counts None: no frequency or presence penalty in the batch."""
    kernel = load_kernel("backends.cuda.kernels.penalties", "apply_penalties_kernel")
    n, vocab = positions.shape[0], logits.shape[1]
    if n == 0:
        return logits
    assert logits.stride(1) == 1 and seen.stride(1) == 1 and seen.is_contiguous()
    seen_bytes = seen.view(torch.uint8)  # bool rows, read as bytes
    kernel[(n, triton_cdiv(vocab, BLOCK))](
        logits,
        logits.stride(0),
        positions,
        rows,
        seen_bytes,
        counts if counts is not None else seen_bytes,
        seen.stride(0),
        repetition,
        frequency,
        presence,
        vocab,
        HAS_COUNTS=counts is not None,
        BLOCK=BLOCK,
    )
    return logits


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
