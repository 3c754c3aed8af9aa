"""HPU prefill bucketing on CPU: grouping and padding, the padded attention, a tiny Llama's padded prefill against
the unpadded one (logits, KV pages, op shapes), no compile after warm-up, and the whole engine's greedy tokens; the
same for steps with a cached prefix (buckets with context pages), and the FusedSDPA call against a CPU fake."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch
from fake_fused_sdpa import install_fake_fused_sdpa
from helpers import hpu_device_config, load_tiny_llama, run_staggered
from test_hpu_attention import ShapeTrace

import backends.hpu.prompt_attention as prompt_attention_module
from backends.cpu.platform import CpuPlatform
from backends.hpu.bucketing import PAD_SLOT, BucketOverflowError, HpuBucketConfig, choose_prompt_bucket
from backends.hpu.fused_sdpa import fused_prompt_attention, load_fused_sdpa
from backends.hpu.platform import HpuEngineRunner, HpuPlatform
from backends.hpu.prefill import (
    REASON_PREFIX_OFF,
    REASON_PREFIX_TOO_LONG,
    group_prompts,
    pad_prompt_batch,
    prompt_rows,
    unbucketable_reason,
)
from backends.hpu.prefill_runner import HpuPrefillRunner
from backends.hpu.prompt_attention import HpuPromptMetadata, padded_prompt_attention
from engine.config import EngineConfig
from engine.engine import Engine
from engine.forward_batch import extend_forward_batch
from engine.kv_cache import KVPool
from engine.layers.attention import AttentionMetadata, step_context
from engine.layers.torch_attention import extend_attention
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.step_message import ExtendMessage, extend_message
from graphs.compiled_step import compile_count

PAGE = 8
BUCKETS = [(1, 16), (1, 32), (2, 16), (2, 32)]


def hpu_engine_on_cpu(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], ranges: dict[str, tuple[int, int, int]]
) -> Engine:
    """An engine on the CPU built the way a Gaudi engine is (HPU decode and prefill runners in eager mode, the
    HPU attention backend), with the hpu: bucket ranges <name>_bucket = ranges[NAME] (NAME like PROMPT_BS)."""
    config = hpu_device_config(**{f"{name.lower()}_bucket": tuple(bounds) for name, bounds in ranges.items()})
    monkeypatch.setattr(
        CpuPlatform,
        "graph_runner_class",
        lambda self: (
            lambda *a, strict=None, **k: HpuEngineRunner(
                *a, mode="eager", show_progress=False, device_config=config, **k
            )
        ),
    )
    monkeypatch.setattr(
        CpuPlatform,
        "prefill_runner_class",
        lambda self: (
            lambda *a: HpuPrefillRunner.from_engine(*a, mode="eager", show_progress=False, device_config=config)
        ),
    )
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self: HpuPlatform().attention_backend())
    return Engine(capture_sizes="1,2,4", **options)


def record_buckets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The bucket of every padded prefill batch HpuPrefillRunner runs from now on, in order."""
    used: list[tuple[int, ...]] = []
    run = HpuPrefillRunner._run

    def recorded(self: HpuPrefillRunner, batch: Any) -> torch.Tensor:
        used.append(batch.bucket)
        return run(self, batch)

    monkeypatch.setattr(HpuPrefillRunner, "_run", recorded)
    return used


# ---- host side: bucket choice, grouping, padding ----------------------------------------------


def test_choose_prompt_bucket_fits_every_dimension() -> None:
    product = [(1, 128), (1, 256), (2, 128), (2, 256)]
    assert choose_prompt_bucket(1, 100, product) == (1, 128)
    assert choose_prompt_bucket(1, 128, product) == (1, 128)
    assert choose_prompt_bucket(2, 129, product) == (2, 256)
    with pytest.raises(BucketOverflowError, match="fit no prompt bucket"):
        choose_prompt_bucket(3, 10, product)
    with pytest.raises(BucketOverflowError):
        choose_prompt_bucket(1, 257, product)
    # Not a product: tuple order would give (2, 128) for (1, 300), which does not hold it.
    assert choose_prompt_bucket(1, 300, [(1, 128), (2, 128), (2, 512)]) == (2, 512)
    # Fewest padded tokens: (4, 64) holds 2 x 60 in 256 tokens, (2, 256) would take 512.
    assert choose_prompt_bucket(2, 60, [(2, 256), (4, 64)]) == (4, 64)


def test_group_prompts_merges_in_order_while_a_bucket_fits() -> None:
    assert group_prompts([5, 13, 30, 3], BUCKETS) == [(range(2), (2, 16)), (range(2, 4), (2, 32))]
    assert group_prompts([20, 3, 3], BUCKETS) == [(range(2), (2, 32)), (range(2, 3), (1, 16))]
    assert group_prompts([16], BUCKETS) == [(range(1), (1, 16))]
    with pytest.raises(BucketOverflowError):
        group_prompts([3, 33], BUCKETS)


def _message(lengths: list[int], seed: int = 0, cached: list[int] | None = None) -> tuple[ExtendMessage, list[Request]]:
    """An extend message of prompts with the given lengths on scattered pages (ids 1..), as the engine builds it."""
    rng = random.Random(seed)
    cached = cached or [0] * len(lengths)
    requests, pages = [], {}
    free = rng.sample(range(1, 64), 63)
    for i, n in enumerate(lengths):
        request = Request(f"r{i}", [rng.randrange(3, 256) for _ in range(n)], SamplingParams())
        request.num_cached_tokens = cached[i]
        pages[request.request_id] = [free.pop() for _ in range(-(-n // PAGE))]
        requests.append(request)
    return extend_message(requests, pages, PAGE), requests


def test_pad_prompt_batch_sends_padding_to_the_dummy_slot() -> None:
    message, _ = _message([5, 13])
    rows = prompt_rows(message)
    batch = pad_prompt_batch(rows, (4, 16))
    assert batch.bucket == (4, 16) and batch.num_real == 2 and batch.sampled_rows == [0, 1]
    assert batch.input_ids.shape == batch.positions.shape == batch.slot_indices.shape == (64,)
    assert batch.seq_lens.tolist() == [5, 13, 0, 0] and batch.seq_lens.dtype == torch.int32
    assert batch.last_index.tolist() == [4, 16 + 12, 32, 48]
    ids, slots, positions = batch.input_ids.view(4, 16), batch.slot_indices.view(4, 16), batch.positions.view(4, 16)
    for r, row in enumerate(rows):
        n = len(row.input_ids)
        assert ids[r, :n].tolist() == row.input_ids and slots[r, :n].tolist() == row.slots
        assert positions[r, :n].tolist() == list(range(n))
        assert not ids[r, n:].any() and bool((slots[r, n:] == PAD_SLOT).all()) and not positions[r, n:].any()
    assert bool((slots[2:] == PAD_SLOT).all()) and PAD_SLOT < PAGE  # inside page 0, which is never handed out
    with pytest.raises(BucketOverflowError):
        pad_prompt_batch(rows, (1, 16))


def test_unbucketable_steps_say_why() -> None:
    assert unbucketable_reason(_message([5, 13])[0], BUCKETS) is None
    assert "longer than the largest" in str(unbucketable_reason(_message([5, 33])[0], BUCKETS))
    assert "cached prefix" in str(unbucketable_reason(_message([12], cached=[8])[0], BUCKETS))
    message, _ = _message([5])
    message.prompt_logprob_requests = [0]
    assert "prompt logprobs" in str(unbucketable_reason(message, BUCKETS))


def test_prompt_buckets_stop_at_the_first_that_holds_the_longest_prompt() -> None:
    config = HpuBucketConfig("linear", [1], [4], [1, 2], [128, 256, 384, 512], 128, 4, 1024)
    assert config.prompt_pairs() == [(1, 128), (1, 256), (1, 384), (1, 512), (2, 128), (2, 256), (2, 384), (2, 512)]
    assert config.prompt_pairs(max_prompt_len=200) == [(1, 128), (1, 256), (2, 128), (2, 256)]
    assert config.prompt_pairs(max_prompt_len=5000) == config.prompt_pairs()


# ---- the padded attention against the ragged one ------------------------------------------------


def test_padded_prompt_attention_equals_ragged_extend_attention() -> None:
    torch.manual_seed(3)
    heads, kv_heads, dim, rows, seq = 4, 2, 16, 3, 12
    lengths = [7, 12, 1]  # a full row, a short one, a one-token one
    q = torch.randn(rows * seq, heads, dim)
    k, v = torch.randn(rows * seq, kv_heads, dim), torch.randn(rows * seq, kv_heads, dim)
    meta = HpuPromptMetadata.from_lengths(torch.tensor([*lengths, 0]), seq, torch.float32)  # and a padded row
    assert meta.attn_bias.shape == (4, 1, seq, seq)
    pad = torch.zeros(seq, heads, dim), torch.zeros(seq, kv_heads, dim)
    q, k, v = torch.cat([q, pad[0]]), torch.cat([k, pad[1]]), torch.cat([v, pad[1]])
    out = padded_prompt_attention(q, k, v, meta, dim**-0.5)
    assert torch.isfinite(out).all()  # padded queries (past a prompt's end, and the padded row) included
    # The reference: each prompt alone through the ragged extend attention, its k/v in a cache of page size 1.
    k_cache, v_cache = torch.zeros(1 + rows * seq, kv_heads, dim), torch.zeros(1 + rows * seq, kv_heads, dim)
    ref = []
    for r, n in enumerate(lengths):
        tokens = torch.arange(r * seq, r * seq + n)
        slots = tokens + 1  # slot 0 stays unused
        k_cache[slots], v_cache[slots] = k[tokens], v[tokens]
        one = AttentionMetadata(
            is_decode=False,
            slot_indices=slots,
            page_table=slots.view(1, -1).to(torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            page_size=1,
            query_start_loc=[0, n],
            seq_lens_cpu=[n],
        )
        ref.append(extend_attention(q[tokens], k_cache, v_cache, one, dim**-0.5))
    real = torch.cat([torch.arange(r * seq, r * seq + n) for r, n in enumerate(lengths)])
    torch.testing.assert_close(out[real], torch.cat(ref), atol=1e-5, rtol=1e-5)
    # bf16 (Gaudi's dtype) with the softmax in fp32 stays close to the fp32 result.
    bf16 = padded_prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), meta, dim**-0.5, fp32_softmax=True)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), out, atol=3e-2, rtol=3e-2)


# ---- a tiny Llama: the padded prefill against the unpadded one ------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, str]:
    folder = str(tmp_path_factory.mktemp("tiny_hpu_prefill"))
    model, config = load_tiny_llama(folder, num_hidden_layers=2)
    model.set_attention_backend(HpuPlatform().attention_backend())
    return model, config, folder


def _random_pool(config: Any, pages: int = 64) -> KVPool:
    """A KV pool full of random values, so that a write anywhere shows."""
    pool = KVPool(
        config.num_hidden_layers,
        pages,
        PAGE,
        config.num_key_value_heads,
        config.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    torch.manual_seed(11)
    for k, v in pool.caches:
        k.normal_()
        v.normal_()
    return pool


@torch.no_grad()
def _unpadded_logits(model: Any, message: ExtendMessage, requests: list[Request], caches: Any) -> torch.Tensor:
    """The unpadded path (ModelRunner's eager extend step): the exact token count, the ragged attention."""
    batch = extend_forward_batch(message, requests, PAGE, torch.device("cpu"))
    with step_context(model.attention_backend, batch.meta):
        hidden = model(batch.input_ids, batch.positions, caches, batch.meta)
    return model.compute_logits(hidden[batch.logits_indices])


def test_padded_prefill_equals_unpadded(tiny: tuple[Any, Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    model, config, _ = tiny
    pool = _random_pool(config)
    runner = HpuPrefillRunner(model, pool.caches, PAGE, "cpu", buckets=BUCKETS, mode="eager", show_progress=False)
    before = [(k.clone(), v.clone()) for k, v in pool.caches]
    runner.capture()  # every bucket once, writing the dummy slot only
    for (k, v), (k0, v0) in zip(pool.caches, before):
        k[PAD_SLOT], v[PAD_SLOT] = k0[PAD_SLOT], v0[PAD_SLOT]
        assert torch.equal(k, k0) and torch.equal(v, v0)
    traces: dict[tuple[int, int], list[tuple]] = {}
    step = runner._fn

    def traced(*inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs[3].shape[0]
        with ShapeTrace() as trace:
            out = step(*inputs)
        traces.setdefault((rows, inputs[0].shape[0] // rows), []).append(tuple(trace.ops))
        return out

    monkeypatch.setattr(runner, "_fn", traced)
    # Several lengths per bucket: (1, 16) x 3, (2, 16) x 2, (1, 32) x 2, (2, 32) x 2.
    cases = [[9], [12], [16], [3, 16], [11, 7], [20], [32], [17, 25], [2, 30]]
    for seed, lengths in enumerate(cases):
        message, requests = _message(lengths, seed)
        ref_caches = [(k.clone(), v.clone()) for k, v in pool.caches]
        with torch.no_grad():
            logits = runner.run_prefill(message)
        ref = _unpadded_logits(model, message, requests, ref_caches)
        assert logits is not None and logits.shape == (len(lengths), config.vocab_size)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        real = torch.tensor(message.slots)
        for layer, ((k, v), (rk, rv)) in enumerate(zip(pool.caches, ref_caches)):
            for got, want in ((k, rk), (v, rv)):
                if layer == 0:  # the first layer's k/v depend on the embeddings alone: bit for bit
                    assert torch.equal(got[real], want[real])
                torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
                # Every other slot as the unpadded path left it, but the dummy one that padding writes.
                others = torch.ones(got.shape[0], dtype=torch.bool)
                others[real] = False
                others[PAD_SLOT] = False
                assert torch.equal(got[others], want[others])
    assert runner.padded_steps == len(cases)  # one forward per group (each case is one); warm-up not counted
    # Every prompt length of a bucket ran exactly the same ops on exactly the same shapes.
    assert sorted(traces) == sorted(BUCKETS)
    for bucket, runs in traces.items():
        assert len(runs) >= 2 and all(run == runs[0] for run in runs), bucket


def test_compiled_prefill_never_recompiles_after_warmup(tiny: tuple[Any, Any, str]) -> None:
    # torch.compile(dynamic=False) with dynamo's eager backend stands in for hpu_backend.
    model, config, _ = tiny
    buckets = [(1, 16), (2, 16)]
    pool = _random_pool(config)
    eager = HpuPrefillRunner(model, pool.caches, PAGE, "cpu", buckets=buckets, mode="eager", show_progress=False)
    compiled = HpuPrefillRunner(
        model, pool.caches, PAGE, "cpu", buckets=buckets, mode="compile", compile_backend="eager", show_progress=False
    )
    start = compile_count()
    compiled.capture()
    assert compile_count() - start >= len(buckets)  # one entry per bucket at least
    for seed, lengths in enumerate([[5], [16], [3, 16], [11, 7], [1]]):
        message, _ = _message(lengths, seed)
        with torch.no_grad():
            got, want = compiled.run_prefill(message), eager.run_prefill(message)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert compiled.compiles_after_warmup == 0


# ---- the engine: greedy tokens with HPU bucketing (prefill and decode) equal the plain CPU engine's --------


def test_engine_with_hpu_prompt_buckets_gives_the_same_tokens(
    tiny: tuple[Any, Any, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, folder = tiny
    prompts = [[5, 9, 14], list(range(40, 52)), list(range(3, 40)), [7] * 19, [11, 12, 13, 14, 15, 16]]
    arrivals = [0, 0, 2, 2, 5]  # 3 + 12 tokens share a (2, 16) batch; 37 is past every bucket; 6 arrives alone
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = dict(
        model=folder,
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=4,
        kv_cache_tokens=1024,
        max_model_len=128,
        enable_prefix_caching=False,
        debug_kv_invariant=True,
        max_extend_step_ms=0,
    )
    want = run_staggered(Engine(disable_graphs=True, **options), prompts, params, arrivals).token_ids

    factory = HpuPlatform().prefill_runner_class()  # what a Gaudi engine gets: the engine's hpu: settings bound
    assert factory.func == HpuPrefillRunner.from_engine and factory.keywords["device_config"]["hpu"]["prompt_bs_bucket"]
    caplog.set_level(logging.WARNING, logger="backends.hpu.prefill_runner")
    engine = hpu_engine_on_cpu(
        monkeypatch, options, {"PROMPT_BS": (1, 1, 2), "PROMPT_SEQ": (8, 16, 32), "DECODE_BLOCK": (4, 4, 32)}
    )
    runner = engine.runner.runner_of(HpuPrefillRunner)
    assert isinstance(runner, HpuPrefillRunner) and runner.buckets == [
        (1, 8),
        (1, 16),
        (1, 32),
        (2, 8),
        (2, 16),
        (2, 32),
    ]
    used = record_buckets(monkeypatch)
    eager_before = engine.runner.eager_steps
    got = run_staggered(engine, prompts, params, arrivals)
    assert got.token_ids == want
    assert used == [(2, 16), (1, 8)]  # the first two prompts in one batch; the last alone
    assert engine.runner.eager_steps - eager_before == 1  # the step with the 37-token prompt, unpadded
    # Logged once, though two steps were too long: the engine's own 126-token warm-up request, then the 37 tokens.
    assert sum("longer than the largest prompt bucket" in r.getMessage() for r in caplog.records) == 1


# ---- cached prefixes: buckets (rows, tokens per row, context pages per row) ------------------------------------

CTX_BUCKETS = [(1, 16, 2), (1, 32, 4), (2, 16, 4)]
# (total tokens, cached tokens) per prompt, and the bucket each case lands on: prefixes ending mid-page (5, 13, 29,
# 17, 3) and of exactly whole pages (8, 16, 32, 24), several prompt and prefix lengths per bucket, a prompt with
# no prefix sharing a batch with one that has one, and 1-token suffixes.
PREFIX_CASES = [
    (([12], [8]), (1, 16, 2)),
    (([20], [5]), (1, 16, 2)),
    (([26], [16]), (1, 16, 2)),
    (([14], [13]), (1, 16, 2)),
    (([40], [29]), (1, 32, 4)),
    (([50], [32]), (1, 32, 4)),
    (([12, 30], [8, 24]), (2, 16, 4)),
    (([10, 20], [0, 17]), (2, 16, 4)),
    (([7, 33], [3, 32]), (2, 16, 4)),
]


def test_prefix_steps_are_bucketed_when_a_bucket_holds_them() -> None:
    message, _ = _message([12], cached=[8])
    assert unbucketable_reason(message, BUCKETS) == REASON_PREFIX_OFF  # no context buckets: refused, as before
    assert unbucketable_reason(message, BUCKETS, CTX_BUCKETS, PAGE) is None
    assert unbucketable_reason(_message([10, 20], cached=[0, 17])[0], BUCKETS, CTX_BUCKETS, PAGE) is None
    # 5 pages of prefix, or 33 new tokens after one: past every bucket, with the same fixed text.
    assert unbucketable_reason(_message([40], cached=[33])[0], BUCKETS, CTX_BUCKETS, PAGE) == REASON_PREFIX_TOO_LONG
    assert unbucketable_reason(_message([41], cached=[8])[0], BUCKETS, CTX_BUCKETS, PAGE) == REASON_PREFIX_TOO_LONG
    assert "longer than the largest" in str(
        unbucketable_reason(_message([33, 9], cached=[0, 8])[0], BUCKETS, CTX_BUCKETS, PAGE)
    )
    # Grouping: prompts without a prefix keep 2-D buckets; a batch with one takes a 3-D bucket.
    # The third prompt alone: 3 prefix pages, and (1, 32, 4) pads fewer tokens (64) than (2, 16, 4) (96).
    assert group_prompts([5, 4, 6], BUCKETS, [0, 1, 3], CTX_BUCKETS, PAGE) == [
        (range(2), (2, 16, 4)),
        (range(2, 3), (1, 32, 4)),
    ]
    assert group_prompts([5, 9], BUCKETS, [0, 0], CTX_BUCKETS, PAGE) == [(range(2), (2, 16))]


def test_pad_prompt_batch_with_a_prefix_pads_pages_with_the_dummy_page() -> None:
    message, _requests = _message([12, 30], cached=[8, 19])
    rows = prompt_rows(message)
    assert [(r.prefix_len, r.ctx_pages(PAGE)) for r in rows] == [(8, 1), (19, 3)]
    batch = pad_prompt_batch(rows, (3, 16, 4), page_size=PAGE)
    assert batch.bucket == (3, 16, 4) and batch.seq_lens.tolist() == [4, 11, 0]
    assert batch.ctx_lens is not None and batch.ctx_lens.tolist() == [8, 19, 0] and batch.ctx_lens.dtype == torch.int32
    assert batch.ctx_pages is not None and batch.ctx_pages.shape == (3, 4)
    assert batch.ctx_pages[0].tolist() == [*message.page_rows[0][:1], 0, 0, 0]
    assert batch.ctx_pages[1].tolist() == [*message.page_rows[1][:3], 0]
    assert not batch.ctx_pages[2].any() and len(batch.step_inputs()) == 7
    assert batch.positions.view(3, 16)[1, :11].tolist() == list(range(19, 30))
    with pytest.raises(BucketOverflowError):
        pad_prompt_batch(rows, (2, 16, 2), page_size=PAGE)  # the second prefix needs 3 pages
    with pytest.raises(ValueError, match="context pages"):
        pad_prompt_batch(rows, (2, 16))


def _prefix_attention_case(cases: list[tuple[int, int]], seq: int, ctx: int, seed: int = 5) -> tuple[torch.Tensor, ...]:
    """Random q/k/v for rows of (new tokens, prefix tokens) plus one padded row, caches holding random prefixes
    and this step's k/v (as store_kv leaves them); returns (q, k, v, k_cache, v_cache, seq_lens, ctx_lens,
    ctx_pages, reference output of the real tokens, their flat indices)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    heads, kv_heads, dim, rows = 4, 2, 16, len(cases) + 1
    k_cache, v_cache = torch.randn(48 * PAGE, kv_heads, dim), torch.randn(48 * PAGE, kv_heads, dim)
    q = torch.randn(rows * seq, heads, dim)
    k, v = torch.randn(rows * seq, kv_heads, dim), torch.randn(rows * seq, kv_heads, dim)
    free = rng.sample(range(1, 48), 47)
    seq_lens, ctx_lens = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    ctx_pages = torch.zeros(rows, ctx, dtype=torch.int64)
    slots = torch.full((rows * seq,), PAD_SLOT, dtype=torch.int64)
    refs, real, tables = [], [], []
    for r, (n, prefix) in enumerate(cases):
        pages = [free.pop() for _ in range(-(-(n + prefix) // PAGE))]
        tables.append(torch.tensor(pages, dtype=torch.int32).view(1, -1))
        tokens = torch.arange(r * seq, r * seq + n)
        slots[tokens] = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(prefix, prefix + n)])
        seq_lens[r], ctx_lens[r] = n, prefix
        used = -(-prefix // PAGE)
        ctx_pages[r, :used] = torch.tensor(pages[:used], dtype=torch.int64)
        real.append(tokens)
    k_cache[slots], v_cache[slots] = k, v  # the store before attention (padded tokens: the dummy slot)
    for r, (n, prefix) in enumerate(cases):
        total = n + prefix
        one = AttentionMetadata(
            is_decode=False,
            slot_indices=slots[real[r]],
            page_table=tables[r],
            seq_lens=torch.tensor([total], dtype=torch.int32),
            page_size=PAGE,
            query_start_loc=[0, n],
            seq_lens_cpu=[total],
        )
        refs.append(extend_attention(q[real[r]], k_cache, v_cache, one, dim**-0.5))
    return q, k, v, k_cache, v_cache, seq_lens, ctx_lens, ctx_pages, torch.cat(refs), torch.cat(real)


def test_padded_prompt_attention_with_a_prefix_equals_ragged_extend_attention() -> None:
    # Prefixes mid-page (5, 13), of whole pages (8, 16), empty (a row without one), and a padded row.
    cases, seq, ctx = [(7, 5), (12, 16), (1, 13), (9, 0), (3, 8)], 12, 3
    q, k, v, k_cache, v_cache, seq_lens, ctx_lens, ctx_pages, ref, real = _prefix_attention_case(cases, seq, ctx)
    meta = HpuPromptMetadata.from_lengths(seq_lens, seq, torch.float32, ctx_lens, ctx_pages, PAGE)
    assert meta.attn_bias is not None and meta.attn_bias.shape == (len(cases) + 1, 1, seq, ctx * PAGE + seq)
    out = padded_prompt_attention(q, k, v, meta, 16**-0.5, k_cache=k_cache, v_cache=v_cache)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[real], ref, atol=1e-5, rtol=1e-5)
    # The mask matters: every prefix key visible (page padding, and the slots the new tokens were just written
    # to in a mid-page prefix), or none, gives other results.
    for wrong in (torch.full_like(ctx_lens, ctx * PAGE), torch.zeros_like(ctx_lens)):
        broken = HpuPromptMetadata.from_lengths(seq_lens, seq, torch.float32, wrong, ctx_pages, PAGE)
        bad = padded_prompt_attention(q, k, v, broken, 16**-0.5, k_cache=k_cache, v_cache=v_cache)
        assert not torch.allclose(bad[real], ref, atol=1e-3)
    # bf16 with the softmax in fp32 stays close to the fp32 result.
    bf16 = padded_prompt_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), meta, 16**-0.5, True, k_cache.bfloat16(), v_cache.bfloat16()
    )
    torch.testing.assert_close(bf16.float(), out, atol=3e-2, rtol=3e-2)


def test_prefix_prefill_equals_unpadded(tiny: tuple[Any, Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    model, config, _ = tiny
    pool = _random_pool(config)
    runner = HpuPrefillRunner(
        model, pool.caches, PAGE, "cpu", buckets=BUCKETS, ctx_buckets=CTX_BUCKETS, mode="eager", show_progress=False
    )
    before = [(k.clone(), v.clone()) for k, v in pool.caches]
    runner.capture()  # every bucket once, the 3-D ones too, writing the dummy slot only
    for (k, v), (k0, v0) in zip(pool.caches, before):
        k[PAD_SLOT], v[PAD_SLOT] = k0[PAD_SLOT], v0[PAD_SLOT]
        assert torch.equal(k, k0) and torch.equal(v, v0)
    traces: dict[tuple[int, ...], list[tuple]] = {}
    used: list[tuple[int, ...]] = []
    step, run = runner._fn, runner._run

    def traced(*inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs[3].shape[0]
        key = (rows, inputs[0].shape[0] // rows) + ((inputs[6].shape[1],) if len(inputs) > 5 else ())
        with ShapeTrace() as trace:
            out = step(*inputs)
        traces.setdefault(key, []).append(tuple(trace.ops))
        return out

    def recorded(batch: Any) -> torch.Tensor:
        used.append(batch.bucket)
        return run(batch)

    monkeypatch.setattr(runner, "_fn", traced)
    monkeypatch.setattr(runner, "_run", recorded)
    for seed, ((lengths, cached), bucket) in enumerate(PREFIX_CASES):
        message, requests = _message(lengths, seed, cached)
        assert runner.fits(message)
        ref_caches = [(k.clone(), v.clone()) for k, v in pool.caches]
        with torch.no_grad():
            logits = runner.run_prefill(message)
        assert used[-1] == bucket
        ref = _unpadded_logits(model, message, requests, ref_caches)
        assert logits is not None and logits.shape == (len(lengths), config.vocab_size)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        real = torch.tensor(message.slots)
        for (k, v), (rk, rv) in zip(pool.caches, ref_caches):
            for got, want in ((k, rk), (v, rv)):
                torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
                others = torch.ones(got.shape[0], dtype=torch.bool)
                others[real] = False
                others[PAD_SLOT] = False  # padded tokens and rows write only the dummy slot
                assert torch.equal(got[others], want[others])
    # Every case of a bucket ran exactly the same ops on exactly the same shapes.
    assert sorted(traces) == sorted({bucket for _, bucket in PREFIX_CASES})
    for bucket, runs in traces.items():
        assert len(runs) >= 2 and all(r == runs[0] for r in runs), bucket
    # A wrong prefix mask (every gathered key visible) changes the logits of a prefix that ends mid-page.
    original = prompt_attention_module.prompt_bias

    def all_prefix_visible(seq_lens, seq, dtype, ctx_lens=None, ctx_pages=None, page_size=0):
        if ctx_pages is not None:
            ctx_lens = torch.full_like(ctx_lens, ctx_pages.shape[1] * page_size)
        return original(seq_lens, seq, dtype, ctx_lens, ctx_pages, page_size)

    monkeypatch.setattr(prompt_attention_module, "prompt_bias", all_prefix_visible)
    message, requests = _message([20], 1, [5])
    ref = _unpadded_logits(model, message, requests, [(k.clone(), v.clone()) for k, v in pool.caches])
    with torch.no_grad():
        wrong = runner.run_prefill(message)
    assert wrong is not None and not torch.allclose(wrong, ref, atol=1e-3)


def test_compiled_prefix_prefill_never_recompiles_after_warmup(tiny: tuple[Any, Any, str]) -> None:
    model, config, _ = tiny
    buckets, ctx_buckets = [(1, 16)], [(1, 16, 2), (2, 16, 4)]
    pool = _random_pool(config)
    eager = HpuPrefillRunner(
        model, pool.caches, PAGE, "cpu", buckets=buckets, ctx_buckets=ctx_buckets, mode="eager", show_progress=False
    )
    compiled = HpuPrefillRunner(
        model,
        pool.caches,
        PAGE,
        "cpu",
        buckets=buckets,
        ctx_buckets=ctx_buckets,
        mode="compile",
        compile_backend="eager",
        show_progress=False,
    )
    start = compile_count()
    compiled.capture()
    assert compile_count() - start >= len(buckets) + len(ctx_buckets)
    for seed, (lengths, cached) in enumerate(
        [([12], [8]), ([14], [13]), ([12, 30], [8, 24]), ([10, 20], [0, 17]), ([9], [0])]
    ):
        message, _ = _message(lengths, seed, cached)
        with torch.no_grad():
            got, want = compiled.run_prefill(message), eager.run_prefill(message)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert compiled.compiles_after_warmup == 0


def test_engine_with_prefix_caching_and_prompt_buckets_gives_the_same_tokens(
    tiny: tuple[Any, Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, folder = tiny
    rng = random.Random(7)
    shared = [rng.randrange(3, 200) for _ in range(21)]  # 2 whole pages and 5 tokens
    prompts = [
        [*shared, 5, 9, 14],
        shared + list(range(40, 52)),
        shared[:16] + [7] * 9,
        [*shared, 11],
        list(range(60, 90)),
    ]
    arrivals = [0, 3, 3, 6, 6]  # later ones find the first one's pages cached
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(
        model=folder,
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=4,
        kv_cache_tokens=1024,
        max_model_len=128,
        enable_prefix_caching=True,
        debug_kv_invariant=True,
        max_extend_step_ms=0,
        chunked_prefill_size=16,
    )  # the 30-token prompt runs in chunks: its second one has a prefix
    plain = Engine(disable_graphs=True, **options)
    want = run_staggered(plain, prompts, params, arrivals).token_ids

    engine = hpu_engine_on_cpu(
        monkeypatch,
        options,
        {"PROMPT_BS": (1, 1, 2), "PROMPT_SEQ": (8, 16, 32), "PROMPT_CTX": (1, 2, 4), "DECODE_BLOCK": (4, 4, 32)},
    )
    runner = engine.runner.runner_of(HpuPrefillRunner)
    assert isinstance(runner, HpuPrefillRunner) and {c for _, _, c in runner.ctx_buckets} == {1, 2, 4}
    used = record_buckets(monkeypatch)
    eager_before = engine.runner.eager_steps
    got = run_staggered(engine, prompts, params, arrivals)
    assert got.token_ids == want
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert any(len(bucket) == 3 for bucket in used)  # steps with a cached prefix ran padded
    assert engine.runner.eager_steps == eager_before  # and none ran unpadded


# ---- FusedSDPA (a CPU fake of the kernel: the call plumbing only) ------------------------------------------------


def test_fused_sdpa_setting_decides_whether_the_kernel_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_fused_sdpa("auto") is None  # no bridge on this machine: the masked-matmul fallback
    with pytest.raises(RuntimeError, match="FusedSDPA does not import"):
        load_fused_sdpa("true")
    with pytest.raises(ValueError):
        load_fused_sdpa("sometimes")
    fake = install_fake_fused_sdpa(monkeypatch)
    assert load_fused_sdpa("auto") is fake and load_fused_sdpa(True) is fake and load_fused_sdpa("false") is None
    assert load_fused_sdpa() is fake  # hpu.fused_sdpa's default: auto
    assert HpuPlatform().attention_backend().fused_sdpa is fake  # configs/hpu.yaml: auto
    platform = HpuPlatform()
    platform.configure(EngineConfig(device="hpu", device_options={"hpu": {"fused_sdpa": False}}).resolve(platform))
    assert platform.attention_backend().fused_sdpa is None  # the engine's config, not the YAML file, decides


def test_fused_prompt_attention_calls_the_kernel_as_vllm_hpu_extension_does(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_fused_sdpa(monkeypatch)
    # No prefix: the causal flag and the rows' lengths, no mask tensor.
    torch.manual_seed(2)
    seq, lengths = 12, [7, 12, 1, 0]
    q, k, v = torch.randn(4 * seq, 4, 16), torch.randn(4 * seq, 2, 16), torch.randn(4 * seq, 2, 16)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    causal = HpuPromptMetadata.from_lengths(seq_lens, seq, torch.float32, with_bias=False)
    assert causal.attn_bias is None
    got = fused_prompt_attention(fake, q, k, v, causal, 0.25)
    want = padded_prompt_attention(q, k, v, HpuPromptMetadata.from_lengths(seq_lens, seq, torch.float32), 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    call = fake.calls[-1]
    assert call["attn_mask"] is None and call["is_causal"] is True and call["padding_side"] == "right"
    assert call["valid_sequence_lengths"].tolist() == [7, 12, 1, 1] and call["softmax_mode"] == "fast"
    assert call["recompute_mode"] is True and call["shapes"] == ((4, 4, seq, 16), (4, 2, seq, 16))  # GQA kept
    # The masked fallback run on metadata built for the causal flag still gives the same result.
    torch.testing.assert_close(padded_prompt_attention(q, k, v, causal, 0.25), want, atol=1e-5, rtol=1e-5)
    # A prefix: the explicit mask, no causal flag, no lengths; fp32 softmax asked as "fp32".
    cases, seq, ctx = [(7, 5), (12, 16), (1, 13)], 12, 2
    q, k, v, k_cache, v_cache, seq_lens, ctx_lens, ctx_pages, ref, real = _prefix_attention_case(cases, seq, ctx)
    meta = HpuPromptMetadata.from_lengths(seq_lens, seq, torch.float32, ctx_lens, ctx_pages, PAGE, with_bias=False)
    assert meta.attn_bias is not None  # a prefix always has its mask
    got = fused_prompt_attention(fake, q, k, v, meta, 16**-0.5, True, k_cache, v_cache)
    torch.testing.assert_close(got[real], ref, atol=1e-5, rtol=1e-5)
    call = fake.calls[-1]
    assert call["attn_mask"] is not None and call["is_causal"] is False and call["valid_sequence_lengths"] is None
    assert call["softmax_mode"] == "fp32" and call["shapes"][1] == (4, 2, ctx * PAGE + seq, 16)


def test_prefill_through_the_fused_kernel_equals_the_fallback(
    tiny: tuple[Any, Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, config, _ = tiny
    fake = install_fake_fused_sdpa(monkeypatch)
    backends = {id(m.backend): m.backend for m in model.modules() if hasattr(m, "backend")}
    backends[id(model.attention_backend)] = model.attention_backend
    results: dict[bool, list[torch.Tensor]] = {}
    for fused in (False, True):
        for backend in backends.values():
            monkeypatch.setattr(backend, "fused_sdpa", load_fused_sdpa(fused))
        fake.calls = []
        pool = _random_pool(config)
        runner = HpuPrefillRunner(
            model, pool.caches, PAGE, "cpu", buckets=BUCKETS, ctx_buckets=CTX_BUCKETS, mode="eager", show_progress=False
        )
        results[fused] = []
        for seed, (lengths, cached) in enumerate([([9], [0]), ([3, 16], [0, 0]), ([20], [5]), ([12, 30], [8, 24])]):
            message, _ = _message(lengths, seed, cached)
            with torch.no_grad():
                results[fused].append(runner.run_prefill(message))
        assert bool(fake.calls) == fused  # `false` never calls the kernel
        if fused:
            forms = {(c["is_causal"], c["attn_mask"] is None) for c in fake.calls}
            assert forms == {(True, True), (False, False)}  # the causal form and the masked one both ran
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
