"""The sampler's fused penalty kernel against its torch path, bit for bit.

Without a GPU the Triton kernel runs in Triton's CPU interpreter (compiled on a GPU).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from triton_interpreter import interpreter_mode

from backends.cuda.triton_penalties import apply_penalties_
from engine.penalties import PenaltyState
from engine.request import Request
from engine.sampler import _apply_penalties
from engine.sampling_params import SamplingParams

# CUDA or ROCm: HIP devices are torch "cuda" devices, and Triton compiles the kernels for both.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _penalized_batch(vocab: int, everyone: bool, with_counts: bool) -> tuple[list[Request], PenaltyState, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    state = PenaltyState(16, vocab, torch.device(DEVICE))
    requests, rows = [], []
    for i in range(6):
        penalized = everyone or i % 2 == 0
        params = SamplingParams(
            temperature=0.8,
            repetition_penalty=1.0 + 0.1 * (i + 1) if penalized else 1.0,
            frequency_penalty=0.3 * i if penalized and with_counts else 0.0,
            presence_penalty=0.2 if penalized and with_counts else 0.0,
        )
        prompt = torch.randint(0, vocab, (40,), generator=generator).tolist()
        request = Request(f"r{i}", prompt, params)
        request.output_token_ids = torch.randint(0, vocab, (12,), generator=generator).tolist()
        request.batch_row = 15 - 2 * i  # decode rows out of batch order
        requests.append(request)
        rows.append(request.batch_row)
    return requests, state, torch.tensor(rows, device=DEVICE)


@pytest.mark.parametrize("everyone", [True, False])
@pytest.mark.parametrize("with_counts", [True, False])
def test_penalty_kernel_matches_the_torch_path_bit_for_bit(everyone: bool, with_counts: bool) -> None:
    vocab = 5000  # two kernel blocks, the second one partial
    requests, state, rows = _penalized_batch(vocab, everyone, with_counts)
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[:, :100] = logits[:, :100].abs()  # both signs of the repetition rule
    logits[:, 100:200] = -logits[:, 100:200].abs()
    expected, recorded = _apply_penalties(logits.cpu(), requests, state, rows.cpu()) if not ON_GPU else (None, None)
    if ON_GPU:  # on a GPU _apply_penalties itself takes the kernel; the reference is the CPU torch path
        cpu_state = PenaltyState(16, vocab, torch.device("cpu"))
        expected, recorded = _apply_penalties(logits.cpu(), requests, cpu_state, rows.cpu())
    assert recorded is not None
    positions = [i for i, r in enumerate(requests) if r.params.has_penalties]
    penalized = [requests[i] for i in positions]
    values = torch.tensor(
        [
            [r.params.repetition_penalty for r in penalized],
            [r.params.frequency_penalty for r in penalized],
            [r.params.presence_penalty for r in penalized],
        ],
        device=DEVICE,
    )
    state.fill_new_rows(penalized)
    assert state.seen is not None
    out = logits.clone()
    with nullcontext() if ON_GPU else interpreter_mode():
        apply_penalties_(
            out,
            torch.tensor(positions, device=DEVICE),
            rows[positions],
            state.seen,
            state.counts if with_counts else None,
            *values,
        )
    assert torch.equal(out.cpu(), expected)
    untouched = [i for i in range(len(requests)) if i not in positions]
    assert torch.equal(out[untouched], logits[untouched])
