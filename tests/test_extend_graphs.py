"""The static buffers of extend/mixed-step graphs (graphs/extend_graph_runner.py), without a GPU.

A bucket's buffers hold the step's requests, then one padding request that
owns the tokens past the real ones, then empty requests. Here the step
function is ragged attention itself (Triton's interpreter on CPU, compiled on
a GPU), run on the filled buffers as a replay would, and held against the same
step on the batch's own metadata: the real tokens must come out the same, and
the padding must write nowhere but slot 0.
"""

from __future__ import annotations

import torch
from test_triton_kernels import DEVICE, kernel_mode

from engine.forward_batch import build_forward_batch
from engine.layers.attention import AttentionMetadata
from engine.request import Request
from engine.sampling_params import SamplingParams
from graphs.extend_graph_runner import ExtendGraphRunner

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 32, 16


def attention_step(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """step_fn: q/k/v from fixed tables of token ids and positions, through the Triton backend."""
    from backends.cuda.triton_attention import TritonAttentionBackend

    generator = torch.Generator().manual_seed(0)
    tables = [torch.randn(512, n * DIM, generator=generator).to(DEVICE) for n in (HEADS, KV_HEADS, KV_HEADS)]
    backend = TritonAttentionBackend()

    def step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        keys = (input_ids * 7 + positions) % 512
        q, k, v = (t[keys].view(len(keys), -1, DIM) for t in tables)
        return backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5).flatten(1)

    return step


def test_padded_bucket_gives_the_batch_s_own_result() -> None:
    slots = 64 * PAGE
    caches = [torch.zeros(slots, KV_HEADS, DIM, device=DEVICE) for _ in range(2)]
    # Three requests: one prefilling from scratch, one chunk behind a cached prefix, one decode row.
    requests = [Request(f"r{i}", list(range(3, 3 + n)), SamplingParams()) for i, n in enumerate((20, 45, 9))]
    requests[1].num_cached_tokens = 32
    requests[2].num_cached_tokens = 8
    pages = {"r0": [1, 2], "r1": [3, 4, 5], "r2": [6]}
    lens = [20, 13, 1]
    with kernel_mode():
        step = attention_step(*caches)
        # The prefix of r1 and r2 must be in the cache: run their cached tokens first.
        warm = [
            Request("w1", requests[1].prompt_token_ids[:32], SamplingParams()),
            Request("w2", requests[2].prompt_token_ids[:8], SamplingParams()),
        ]
        prefix = build_forward_batch(
            warm, {"w1": pages["r1"], "w2": pages["r2"]}, PAGE, torch.device(DEVICE), extend_lens=[32, 8]
        )
        step(prefix.input_ids, prefix.positions, prefix.meta)
        batch = build_forward_batch(requests, pages, PAGE, torch.device(DEVICE), extend_lens=lens)
        want = step(batch.input_ids, batch.positions, batch.meta)
        before = [c.clone() for c in caches]  # the padded step rewrites the real slots with the same k/v
        runner = ExtendGraphRunner(
            step, [16, 64, 128], max_requests=8, max_pages=8, page_size=PAGE, device=torch.device(DEVICE)
        )
        runner.fill(batch, 64)  # 34 real tokens, 30 of padding, 4 empty requests
        got = step(runner.input_ids[:64], runner.positions[:64], runner._meta(64))[: batch.input_ids.shape[0]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for cache, old in zip(caches, before):
        changed = (cache != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= {0}, f"the padding wrote slots {changed}"
    assert runner.query_starts.tolist() == [0, 20, 33, 34] + [64] * 6
    assert int(runner.positions[34:64].max()) < PAGE  # the padding's positions stay within one page
    assert runner.seq_lens.tolist()[:5] == [20, 45, 9, 30, 0]
