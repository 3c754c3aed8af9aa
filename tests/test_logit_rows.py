"""The eager LM head's rows padded to a ladder (engine/logit_rows.py; on by default where the platform asks: cuda).

Forced on here on the CPU: the same greedy tokens as unpadded, and the LM head only ever sees the ladder's
row counts (without the padding the same workload gives it others, so the check can fail)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import track
from helpers import run_staggered

from backends.cpu.platform import CpuPlatform
from engine.engine import Engine
from engine.logit_rows import LogitRowLadder
from engine.sampling_params import SamplingParams


def test_ladder_pads_to_the_next_size_and_keeps_rows_past_the_top() -> None:
    ladder = LogitRowLadder([1, 2, 4, 8, 16, 24, 32], max_rows=20)
    assert ladder.sizes == [1, 2, 4, 8, 16, 20]
    assert [ladder.padded_rows(n) for n in (1, 3, 8, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, 21]
    seen: list[int] = []

    def head(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return hidden * 2 + 1

    hidden = torch.randn(5, 3)
    out = ladder.logits(head, hidden)
    assert seen == [8] and torch.equal(out, hidden * 2 + 1)
    # Past the capture sizes the ladder goes on in the last gap's steps, not one jump to max_rows.
    assert LogitRowLadder([1, 2, 4, 8, 16, 24, 32], max_rows=64).sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert LogitRowLadder([4], max_rows=10).sizes == [4, 8, 10]
    assert LogitRowLadder([], max_rows=3).sizes == [3]
    with pytest.raises(ValueError):
        LogitRowLadder([1, 2], max_rows=0)


def _head_rows(engine: Engine) -> list[int]:
    rows: list[int] = []
    engine.model.lm_head.register_forward_pre_hook(lambda _module, args: rows.append(args[0].shape[0]))
    return rows


@pytest.mark.parametrize("mixed", [True, False])
def test_padded_lm_head_gives_the_same_tokens_at_ladder_sizes_only(
    tiny_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch, mixed: bool
) -> None:
    path = tiny_checkpoints["llama"]
    options = dict(
        device="cpu",
        dtype="float32",
        disable_graphs=True,
        kv_cache_tokens=4096,
        max_num_seqs=12,
        max_extend_step_ms=0,
        chunked_prefill_size=48,
        mixed_steps=mixed,
        capture_sizes=[1, 2, 4, 8],
        debug_kv_invariant=True,
    )
    plain = track(Engine(model=path, **options))
    monkeypatch.setattr(CpuPlatform, "pads_logit_rows", True)
    padded = track(Engine(model=path, **options))
    assert padded.runner.logit_rows is not None and padded.runner.logit_rows.sizes == [1, 2, 4, 8, 12]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 70))] for _ in range(14)]
    arrivals = [0, 0, 0, 1, 1, 2, 3, 3, 3, 5, 8, 8, 9, 12]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain_rows, padded_rows = _head_rows(plain), _head_rows(padded)
    want = run_staggered(plain, prompts, params, arrivals)
    got = run_staggered(padded, prompts, params, arrivals)
    assert got.token_ids == want.token_ids
    assert set(padded_rows) <= {1, 2, 4, 8, 12}
    assert set(plain_rows) - {1, 2, 4, 8, 12}, "the workload never gave the LM head a row count off the ladder"
    assert padded.kv_pages_in_use() == 0


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_logits_written_into_a_buffer_in_row_chunks_match_the_plain_head(
    tiny_checkpoints: dict[str, str], name: str
) -> None:
    """The CUDA decode graphs' head writes into their float32 logits buffer HEAD_ROWS_INTO_OUT rows at a time
    (engine/models/decoder.py): the same logits as the head over all rows at once, Gemma 2's soft cap included,
    for a row count that ends inside a chunk."""
    from engine.models.decoder import HEAD_ROWS_INTO_OUT

    engine = track(
        Engine(
            model=tiny_checkpoints[name],
            device="cpu",
            dtype="float32",
            disable_graphs=True,
            kv_cache_tokens=512,
            max_num_seqs=2,
        )
    )
    model, rows = engine.model, 2 * HEAD_ROWS_INTO_OUT + 37
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    head_rows = _head_rows(engine)
    with torch.no_grad():
        want = model.compute_logits(hidden)
        assert head_rows == [rows]
        head_rows.clear()
        out = torch.full_like(want, float("nan"))
        got = model.compute_logits(hidden, out)
    assert got is out and head_rows == [HEAD_ROWS_INTO_OUT, HEAD_ROWS_INTO_OUT, 37]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
