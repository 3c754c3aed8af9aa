"""HPU flat paged attention on CPU: equal to the torch reference, static shapes, and a tiny Llama end to end."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from helpers import hpu_device_config, load_tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from backends.hpu.attention import HpuAttentionBackend, HpuFlatMetadata, flat_paged_attention
from backends.hpu.bucketing import (
    BucketOverflowError,
    build_block_metadata,
    choose_decode_bucket,
    decode_buckets,
    pad_decode_batch,
)
from backends.hpu.graph_runner import HpuDecodeRunner, expected_shapes
from backends.hpu.platform import HpuEngineRunner, HpuPlatform
from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.torch_attention import TorchAttentionBackend, paged_decode_attention

HEADS, KV_HEADS, DIM = 4, 2, 16  # GQA: two query heads per kv head
SCALE = DIM**-0.5


def scattered_batch(
    rng: random.Random, seq_lens: list[int], page_size: int, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page_table, seq_lens, slot of each row's newest token) with pages drawn at random from 1..num_pages-1."""
    need = [-(-n // page_size) for n in seq_lens]
    pages = rng.sample(range(1, num_pages), sum(need))
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for row, count in enumerate(need):
        table[row, :count] = torch.tensor(pages[:count])
        pages = pages[count:]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return table, lens, slots_of(table, lens - 1, page_size)


def slots_of(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of token `positions[i]` of row i of the page table (int64)."""
    pages = table.long().gather(1, (positions.long() // page_size).unsqueeze(1)).squeeze(1)
    return pages * page_size + positions.long() % page_size


def zero_caches(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(slots, KV_HEADS, DIM), torch.zeros(slots, KV_HEADS, DIM)


def decode_meta(
    table: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, page_size: int, flat: Any = None
) -> AttentionMetadata:
    return AttentionMetadata(
        is_decode=True, slot_indices=slots, page_table=table, seq_lens=lens, page_size=page_size, platform_metadata=flat
    )


SEQ_LENS = {  # includes 1, exact page multiples and ragged tails
    1: [[1, 7, 3, 12, 1], [5, 1, 9]],
    16: [[1, 16, 32, 37, 5], [48, 17, 1]],
    128: [[1, 128, 256, 300, 129], [3, 384]],
}


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_flat_attention_equals_torch_reference(page_size: int) -> None:
    rng = random.Random(page_size)
    torch.manual_seed(page_size)
    num_pages = 64 if page_size < 128 else 16
    k_cache = torch.randn(num_pages * page_size, KV_HEADS, DIM)
    v_cache = torch.randn(num_pages * page_size, KV_HEADS, DIM)
    for seq_lens in SEQ_LENS[page_size]:
        n = len(seq_lens)
        table, lens, slots = scattered_batch(rng, seq_lens, page_size, num_pages)
        # As the runner does: pad to a bucket with 2 extra rows and spare filler blocks.
        blocks = int(((lens + page_size - 1) // page_size).sum()) + 2 + 3
        padded = pad_decode_batch(torch.zeros(n), torch.zeros(n), slots, table, lens, (n + 2, blocks), page_size, 64)
        layout = build_block_metadata(padded.page_table, padded.seq_lens, page_size, blocks)
        flat = HpuFlatMetadata.from_block_metadata(page_size=page_size, batch_size=n + 2, **vars(layout))
        q, k, v = torch.randn(n + 2, HEADS, DIM), torch.randn(n + 2, KV_HEADS, DIM), torch.randn(n + 2, KV_HEADS, DIM)

        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        ref = paged_decode_attention(
            q, k, v, ref_k, ref_v, padded.slot_indices, padded.page_table, padded.seq_lens, page_size, SCALE
        )
        got_k, got_v = k_cache.clone(), v_cache.clone()
        meta = decode_meta(padded.page_table, padded.seq_lens, padded.slot_indices, page_size, flat)
        out = HpuAttentionBackend().forward(q, k, v, got_k, got_v, meta, SCALE)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # padded rows too: one token of page 0
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)

        # Unpadded eager step: the backend builds the layout itself from the page table.
        got_k, got_v = k_cache.clone(), v_cache.clone()
        meta = decode_meta(table, lens, slots, page_size)
        out = HpuAttentionBackend().forward(q[:n], k[:n], v[:n], got_k, got_v, meta, SCALE)
        torch.testing.assert_close(out, ref[:n], atol=1e-5, rtol=1e-5)


def test_eager_step_builds_the_layout_once(monkeypatch: pytest.MonkeyPatch) -> None:
    page_size, rng = 4, random.Random(2)
    k_cache, v_cache = torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    table, lens, slots = scattered_batch(rng, [9, 4, 1], page_size, 16)
    q, k, v = torch.randn(3, HEADS, DIM), torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    ref = paged_decode_attention(q, k, v, k_cache.clone(), v_cache.clone(), slots, table, lens, page_size, SCALE)
    calls: list[int] = []
    build = HpuFlatMetadata.from_page_table.__func__  # type: ignore[attr-defined]

    def counting(cls, *args: Any) -> HpuFlatMetadata:
        calls.append(1)
        return build(cls, *args)

    monkeypatch.setattr(HpuFlatMetadata, "from_page_table", classmethod(counting))
    backend, meta = HpuAttentionBackend(), decode_meta(table, lens, slots, page_size)
    with backend.step_context(meta):  # what ModelRunner enters around an eager forward pass
        for _ in range(3):  # three "layers"
            out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1 and meta.platform_metadata is None


def test_softmax_is_stable_across_blocks_with_far_apart_scores() -> None:
    # One row whose blocks' scores differ by ~1e3: a per-row max keeps it finite and exact.
    page_size, rng = 4, random.Random(0)
    k_cache = torch.randn(40, KV_HEADS, DIM)
    k_cache[4:8] *= 300.0  # page 1 scores huge
    table, lens, _ = scattered_batch(rng, [10, 3], page_size, 10)
    table[0, 0] = 1
    q = torch.randn(2, HEADS, DIM)
    flat = HpuFlatMetadata.from_page_table(table, lens, page_size, torch.float32)
    out = flat_paged_attention(q, k_cache, k_cache.clone(), flat, page_size, SCALE)
    ref = paged_decode_attention(
        q,
        q[:, :KV_HEADS],
        q[:, :KV_HEADS],
        k_cache.clone(),
        k_cache.clone(),
        torch.zeros(2, dtype=torch.int64),
        table,
        lens,
        page_size,
        SCALE,
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


def test_bf16_runs_and_stays_close_to_fp32() -> None:
    page_size, rng = 16, random.Random(9)
    k_cache, v_cache = torch.randn(20 * page_size, KV_HEADS, DIM), torch.randn(20 * page_size, KV_HEADS, DIM)
    table, lens, _ = scattered_batch(rng, [40, 1, 16], page_size, 20)
    q = torch.randn(3, HEADS, DIM)
    layout = build_block_metadata(table, lens, page_size, 8)
    flat = HpuFlatMetadata.from_block_metadata(page_size=page_size, batch_size=3, dtype=torch.bfloat16, **vars(layout))
    out = flat_paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), flat, page_size, SCALE)
    exact_layout = HpuFlatMetadata.from_page_table(table, lens, page_size, torch.float32)
    exact = flat_paged_attention(q, k_cache, v_cache, exact_layout, page_size, SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=3e-2)


class ShapeTrace(TorchDispatchMode):
    """Records (op, shapes of tensor args and outputs) of every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        self.ops.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out


def test_every_shape_is_a_bucket_shape() -> None:
    page_size, num_pages, max_blocks = 4, 40, 6
    buckets = decode_buckets([2, 4], [4, 8, 12], max_blocks, num_pages - 1)
    seen: list[tuple[tuple[int, int], dict[str, tuple]]] = []
    k_cache, v_cache = zero_caches(num_pages * page_size)
    backend = HpuAttentionBackend()

    def step(input_ids, positions, slot_indices, page_table, seq_lens, **block):
        shapes = {name: tuple(t.shape) for name, t in dict(block, page_table=page_table, seq_lens=seq_lens).items()}
        bs = input_ids.shape[0]
        flat = HpuFlatMetadata.from_block_metadata(page_size=page_size, batch_size=bs, **block)
        q = torch.ones(bs, HEADS, DIM)
        kv = torch.ones(bs, KV_HEADS, DIM)
        meta = decode_meta(page_table, seq_lens, slot_indices, page_size, flat)
        with ShapeTrace() as trace:
            out = backend.forward(q, kv, kv, k_cache, v_cache, meta, SCALE)
        seen.append(((bs, block["block_list"].shape[0]), dict(shapes, trace=tuple(trace.ops))))
        return out.reshape(bs, -1)

    runner = HpuDecodeRunner(
        step,
        buckets=buckets,
        page_size=page_size,
        max_blocks_per_seq=max_blocks,
        device="cpu",
        mode="eager",
        with_block_metadata=True,
        show_progress=False,
    )
    runner.warmup()
    rng = random.Random(5)
    for _ in range(12):
        lens = [rng.randint(1, max_blocks * page_size) for _ in range(rng.randint(1, 4))]
        while sum(-(-n // page_size) for n in lens) > 12 - 4:  # leave room for padded rows
            lens.pop()
        table, seq_lens, slots = scattered_batch(rng, lens, page_size, num_pages)
        bucket = choose_decode_bucket(seq_lens, page_size, buckets)
        runner.run(torch.zeros(len(lens), dtype=torch.int64), seq_lens.long() - 1, slots, table, seq_lens)
        assert seen[-1][0] == bucket
    traces: dict[tuple[int, int], tuple] = {}
    for bucket, shapes in seen:
        bs, blocks = bucket
        assert bucket in buckets
        expect = expected_shapes(bucket, max_blocks)
        assert shapes["page_table"] == expect["page_table"] and shapes["seq_lens"] == (bs,)
        assert shapes["block_list"] == shapes["block_groups"] == shapes["block_usage"] == (blocks,)
        assert "block_mapping" not in shapes  # built on the device from block_groups, not sent
        # Every op inside attention has the same shapes for every batch of a bucket: data never leaks into shapes.
        assert traces.setdefault(bucket, shapes["trace"]) == shapes["trace"]
    assert len(traces) >= 3


def test_compiled_runner_never_recompiles_after_warmup() -> None:
    # torch.compile(dynamic=False) with dynamo's eager backend stands in for hpu_backend.
    page_size, num_pages, max_blocks = 4, 24, 4
    k_cache, v_cache = zero_caches(num_pages * page_size)
    backend = HpuAttentionBackend()

    def step(input_ids, positions, slot_indices, page_table, seq_lens, **block):
        flat = HpuFlatMetadata.from_block_metadata(page_size=page_size, batch_size=input_ids.shape[0], **block)
        q = positions.float().view(-1, 1, 1).expand(-1, HEADS, DIM) * 0.01
        kv = input_ids.float().view(-1, 1, 1).expand(-1, KV_HEADS, DIM).contiguous()
        meta = decode_meta(page_table, seq_lens, slot_indices, page_size, flat)
        return backend.forward(q, kv, kv, k_cache, v_cache, meta, SCALE).sum(-1)

    runner = HpuDecodeRunner(
        step,
        buckets=[(2, 4), (2, 8)],
        page_size=page_size,
        max_blocks_per_seq=max_blocks,
        device="cpu",
        mode="compile",
        compile_backend="eager",
        strict=True,
        with_block_metadata=True,
        show_progress=False,
    )
    runner.warmup()
    rng = random.Random(1)
    for _ in range(6):
        lens = [rng.randint(1, 12) for _ in range(rng.randint(1, 2))]
        table, seq_lens, slots = scattered_batch(rng, lens, page_size, num_pages)
        # strict: raises RecompileAfterWarmupError if anything compiled
        out = runner.run(torch.arange(1, len(lens) + 1), seq_lens.long() - 1, slots, table, seq_lens)
        assert out.shape == (len(lens), HEADS) and torch.isfinite(out).all()
    assert runner.dynamo_compiles == 2


# ---- end to end: a tiny random Llama through HpuEngineRunner (eager mode) ----------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load_tiny_llama(str(tmp_path_factory.mktemp("tiny_hpu_llama")), num_hidden_layers=2)


def set_backend(model: torch.nn.Module, backend: Any) -> None:
    for module in model.modules():
        if module.__class__.__name__ == "Attention":
            module.backend = backend


def test_hpu_engine_runner_matches_torch_backend(tiny_llama: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kv_cache import KVPool

    model, mc = tiny_llama
    page_size, num_pages, max_pages = 8, 48, 8
    pool = KVPool(
        mc.num_hidden_layers,
        num_pages,
        page_size,
        mc.num_key_value_heads,
        mc.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 16, 23)]  # 16: an exact page multiple
    table, _lens, _ = scattered_batch(rng, [len(p) + 3 for p in prompts], page_size, num_pages)  # room for 3 steps

    # Prefill through the HPU backend's extend path must equal the torch backend's.
    tokens = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    slots = torch.cat(
        [slots_of(table[r].expand(len(p), -1), torch.arange(len(p)), page_size) for r, p in enumerate(prompts)]
    )
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))
    prompt_lens = [len(p) for p in prompts]
    extend = AttentionMetadata(
        is_decode=False,
        slot_indices=slots,
        page_table=table,
        seq_lens=torch.tensor(prompt_lens, dtype=torch.int32),
        page_size=page_size,
        query_start_loc=starts,
        seq_lens_cpu=prompt_lens,
    )
    ref_caches = [(k.clone(), v.clone()) for k, v in pool.caches]
    with torch.no_grad():
        set_backend(model, TorchAttentionBackend())
        ref_hidden = model(tokens, positions, ref_caches, extend)
        set_backend(model, HpuPlatform().attention_backend())
        hidden = model(tokens, positions, pool.caches, extend)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)

    runner = HpuEngineRunner(
        model,
        pool.caches,
        [2, 4],
        max_pages,
        page_size,
        torch.device("cpu"),
        mode="eager",
        show_progress=False,
        device_config=hpu_device_config(decode_block_bucket=(4, 8, 12)),  # small block buckets: 4, 8, 12
    )
    runner.capture()  # warm-up: every bucket, reading and writing only page 0
    assert runner.inner.with_block_metadata and {b for _, b in runner.inner.buckets} >= {4, 8}
    seen: list[tuple[int, int]] = []
    backend = HpuPlatform().attention_backend()

    class Recording(AttentionBackend):
        def forward(self, q, k, v, k_cache, v_cache, meta, scale):
            seen.append((q.shape[0], meta.platform_metadata.block_list.shape[0]))
            return backend.forward(q, k, v, k_cache, v_cache, meta, scale)

    next_ids = torch.tensor([p[-1] for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)  # tokens in the KV so far
    # Batches of 3 (pads to 4) and 2, rows out of order; the last one as if it fit no bucket (eager fallback).
    for rows in ([0, 1, 2], [2, 0], [1, 2, 0], [0, 2]):
        if rows == [0, 2]:

            def overflow(*args: Any) -> torch.Tensor:
                raise BucketOverflowError("test: pretend no bucket fits")

            monkeypatch.setattr(runner.inner, "run", overflow)
        lens_now = lengths[rows] + 1
        positions = lens_now.long() - 1
        slots = slots_of(table[rows], positions, page_size)
        ids = next_ids[rows]
        meta = decode_meta(table[rows], lens_now, slots, page_size)
        with torch.no_grad():
            set_backend(model, TorchAttentionBackend())
            ref = model.compute_logits(model(ids, positions, ref_caches, meta))
            set_backend(model, Recording())
            seen.clear()
            logits = runner.run_batch(ids, positions, meta)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        if rows != [0, 2]:
            assert seen and all(s in runner.inner.buckets for s in seen)  # attention only saw bucket shapes
        else:
            exact = int(((lens_now + page_size - 1) // page_size).sum())  # no padded rows, no filler blocks
            assert seen == [(2, exact)] * mc.num_hidden_layers
        for (k, v), (rk, rv) in zip(pool.caches, ref_caches):
            # Same KV everywhere but page 0, which padded rows (and warm-up) wrote; layer 2 differs by round-off.
            torch.testing.assert_close(k[page_size:], rk[page_size:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[page_size:], rv[page_size:], atol=1e-5, rtol=1e-5)
        next_ids[rows] = logits.argmax(-1)
        lengths[rows] += 1
