"""The sampler's GPU paths against its torch paths: the chunked top-k and the fused penalty kernel.

Both run here without a GPU: the two-stage top-k is plain torch (forced on), and
the Triton penalty kernel runs in Triton's CPU interpreter (compiled on a GPU).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from backends.cuda.triton_penalties import apply_penalties_
from backends.cuda.triton_topk import chunked_topk
from engine.batch_state import PenaltyState
from engine.request import Request
from engine.sampler import _apply_penalties, top_candidates
from engine.sampling_params import SamplingParams
from tests.triton_interpreter import interpreter_mode

ON_GPU = torch.cuda.is_available() and torch.version.hip is None
DEVICE = "cuda" if ON_GPU else "cpu"


# On a GPU the engine's own chunk over real vocabulary sizes; in the interpreter (a bitonic network in
# numpy, ~2 s per program at 4096) the same kernel over 256-wide chunks.
CHUNK = 4096 if ON_GPU else 256
VOCABS = [4096 * 3, 4096 * 5 + 777, 128256] if ON_GPU else [CHUNK * 3, CHUNK * 5 + 77]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [1, 50, 256])
def test_chunked_top_k_gives_what_torch_top_k_gives(vocab: int, k: int) -> None:
    generator = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(4 if ON_GPU else 2, vocab, generator=generator).to(DEVICE)
    logits[0, -5:] = 50.0 + torch.arange(5.0)  # the best of a row in the last, partial chunk
    logits[1, :3] = float("-inf")  # and the worst at the start
    logits[1, 7:11] = -1e30
    with nullcontext() if ON_GPU else interpreter_mode():
        values, ids = chunked_topk(logits, k, chunk=CHUNK)
    expected_values, expected_ids = logits.topk(k, dim=-1)
    assert torch.equal(values, expected_values)  # the logits' own bits, negative ones included
    # The same ids, up to the order of equal logits (float32 normals do tie: ~1 pair per 10k values).
    assert torch.equal(logits.gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist())
    assert (ids == expected_ids).float().mean() > 0.98


@pytest.mark.parametrize("asked", [True, False])
def test_the_sampler_takes_the_kernel_on_gpus_when_asked(monkeypatch: pytest.MonkeyPatch, asked: bool) -> None:
    """The kernel has not run on a GPU yet: the sampler takes it only there, and only with ENGINE_TRITON_TOPK=1."""
    import engine.sampler as sampler

    if asked:
        monkeypatch.setenv("ENGINE_TRITON_TOPK", "1")
    else:
        monkeypatch.delenv("ENGINE_TRITON_TOPK", raising=False)
    calls: list[int] = []

    def spy(logits: torch.Tensor, k: int, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(k)
        return chunked_topk(logits, k, chunk)

    monkeypatch.setattr(sampler, "chunked_topk", spy)
    logits = torch.randn(2, 4096 * 2, device=DEVICE)
    with nullcontext() if ON_GPU else interpreter_mode():
        values, _ = top_candidates(logits, 8)
    assert torch.equal(values, logits.topk(8, dim=-1).values)
    assert calls == ([8] if asked and ON_GPU else [])


def test_top_k_falls_back_to_torch_where_the_kernel_does_not_apply() -> None:
    wide = torch.randn(4, 4096 * 2)
    assert torch.equal(top_candidates(wide, 300, kernel=True)[1], wide.topk(300, dim=-1)[1])  # k too large
    half = wide.to(torch.bfloat16)
    assert torch.equal(top_candidates(half, 10, kernel=True)[1], half.topk(10, dim=-1)[1])  # not float32


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
    values = torch.tensor([[r.params.repetition_penalty for r in penalized], [r.params.frequency_penalty for r in penalized],
                           [r.params.presence_penalty for r in penalized]], device=DEVICE)
    state.fill_new_rows(penalized)
    assert state.seen is not None
    out = logits.clone()
    with nullcontext() if ON_GPU else interpreter_mode():
        apply_penalties_(out, torch.tensor(positions, device=DEVICE), rows[positions], state.seen,
                         state.counts if with_counts else None, *values)
    assert torch.equal(out.cpu(), expected)
    untouched = [i for i in range(len(requests)) if i not in positions]
    assert torch.equal(out[untouched], logits[untouched])
