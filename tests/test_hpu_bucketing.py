"""HPU backend logic on CPU: bucket generation, padding, block layout, the runner's shape guarantee."""

from __future__ import annotations

import importlib
import os
import random
import sys
from typing import Any

import pytest
import torch
import yaml
from conftest import reset_dynamo
from helpers import hpu_device_config

from backends.hpu.attention import block_mapping
from backends.hpu.bucketing import (
    PAD_SEQ_LEN,
    BucketOverflowError,
    BucketRange,
    build_block_metadata,
    choose_decode_bucket,
    choose_prompt_ctx_bucket,
    decode_buckets,
    exponential_buckets,
    find_bucket,
    linear_buckets,
    pad_decode_batch,
    pages_needed,
    prompt_buckets,
    prompt_ctx_buckets,
    resolve_bucket_config,
)
from backends.hpu.graph_runner import (
    HpuDecodeRunner,
    RecompileAfterWarmupError,
    ShapeGuaranteeError,
    check_static_shapes,
    expected_shapes,
    warmup_batch,
)
from backends.hpu.platform import HpuPlatform, resolve_graph_mode
from engine.config import EngineConfig
from engine.platform import CONFIG_DIR, CaptureKind, DeviceUnavailableError


def test_linear_buckets_hand_computed() -> None:
    assert linear_buckets(BucketRange(1, 32, 128)) == [1, 2, 4, 8, 16, 32, 64, 96, 128]
    assert linear_buckets(BucketRange(2, 32, 64)) == [2, 4, 8, 16, 32, 64]
    assert linear_buckets(BucketRange(128, 128, 1024)) == [128, 256, 384, 512, 640, 768, 896, 1024]
    assert linear_buckets(BucketRange(1, 32, 100)) == [1, 2, 4, 8, 16, 32, 64, 96, 100]  # max kept
    assert linear_buckets(BucketRange(48, 32, 128)) == [48, 64, 96, 128]  # min kept
    assert linear_buckets(BucketRange(5, 5, 5)) == [5]


def test_exponential_buckets_hand_computed() -> None:
    assert exponential_buckets(BucketRange(1, 1, 64)) == [1, 2, 4, 8, 16, 32, 64]  # 8.000000000000002 -> 8
    assert exponential_buckets(BucketRange(1, 1, 100)) == [1, 2, 4, 8, 14, 27, 52, 100]
    assert exponential_buckets(BucketRange(1, 8, 64)) == [1, 8, 16, 32, 64]  # rounded up to step, deduped
    assert exponential_buckets(BucketRange(3, 1, 3)) == [3]
    assert len(exponential_buckets(BucketRange(1, 1, 4096))) <= 13  # about log2(max) + 1


@pytest.mark.parametrize("bad", [(0, 1, 4), (1, 0, 4), (8, 1, 4)])
def test_bucket_range_rejects_nonsense(bad: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        BucketRange(*bad)


def test_decode_buckets_keep_only_valid_pairs() -> None:
    assert decode_buckets([1, 2, 4], [2, 4, 8, 16], max_blocks_per_seq=4) == [
        (1, 2),
        (1, 4),
        (2, 2),
        (2, 4),
        (2, 8),
        (4, 4),
        (4, 8),
        (4, 16),
    ]
    # A memory cap adds (bs, cap) so the largest batches of each size still have a bucket.
    assert decode_buckets([1, 2, 4], [2, 4, 8, 16], 4, max_blocks_total=6) == [
        (1, 2),
        (1, 4),
        (2, 2),
        (2, 4),
        (2, 6),
        (4, 4),
        (4, 6),
    ]
    # Block buckets starting above bs * max_blocks_per_seq: the cap is the only bucket.
    assert decode_buckets([1], [128, 256], max_blocks_per_seq=32) == [(1, 32)]
    assert prompt_buckets([1, 2], [128, 256], max_num_batched_tokens=256) == [(1, 128), (1, 256), (2, 128)]


def test_find_bucket_edges() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [find_bucket(v, sizes) for v in (0, 1, 3, 4, 9, 16)] == [1, 1, 4, 4, 16, 16]
    with pytest.raises(BucketOverflowError, match="17 exceeds the largest bucket 16"):
        find_bucket(17, sizes)
    with pytest.raises(ValueError):
        find_bucket(-1, sizes)
    with pytest.raises(ValueError):
        find_bucket(1, [])


def _random_batch(rng: random.Random, n: int, page_size: int, max_pages: int, width: int) -> dict[str, torch.Tensor]:
    seq_lens = torch.tensor([rng.randint(1, max_pages * page_size) for _ in range(n)], dtype=torch.int32)
    page_table = torch.zeros(n, width, dtype=torch.int32)
    for i, pages in enumerate(pages_needed(seq_lens, page_size).tolist()):
        page_table[i, :pages] = torch.tensor(rng.sample(range(1, 1000), pages), dtype=torch.int32)
    last_pages = page_table[torch.arange(n), pages_needed(seq_lens, page_size) - 1].to(torch.int64)
    slots = last_pages * page_size + (seq_lens.to(torch.int64) - 1) % page_size
    return {
        "input_ids": torch.tensor([rng.randint(1, 50000) for _ in range(n)]),
        "positions": (seq_lens - 1).to(torch.int64),
        "slot_indices": slots,
        "page_table": page_table,
        "seq_lens": seq_lens,
    }


def test_padding_always_lands_on_a_bucket_shape() -> None:
    page_size, max_pages = 4, 8
    bs_list = linear_buckets(BucketRange(1, 4, 16))
    buckets = decode_buckets(bs_list, linear_buckets(BucketRange(2, 8, 64)), max_pages)
    rng = random.Random(1234)
    for _ in range(200):
        n = rng.randint(1, 16)
        raw = _random_batch(rng, n, page_size, max_pages, width=max_pages + rng.randint(0, 3))
        bucket = choose_decode_bucket(raw["seq_lens"], page_size, buckets)
        padded = pad_decode_batch(**raw, bucket=bucket, page_size=page_size, max_blocks_per_seq=max_pages)
        bs, blocks = bucket
        assert bucket in buckets and bs == find_bucket(n, bs_list)
        need = int(pages_needed(raw["seq_lens"], page_size).sum()) + (bs - n)
        assert blocks >= need and not any(b == bs and need <= x < blocks for b, x in buckets)  # smallest fit
        check_static_shapes(padded, set(buckets), max_pages)  # exact bucket shapes
        assert padded.page_table.dtype == torch.int32 and padded.seq_lens.dtype == torch.int32
        # Real rows unchanged, padded rows aimed at the dummy slot/page.
        used = pages_needed(raw["seq_lens"], page_size)
        for name in ("input_ids", "positions", "slot_indices", "seq_lens"):
            assert torch.equal(getattr(padded, name)[:n], raw[name].to(getattr(padded, name).dtype))
        for i in range(n):
            assert torch.equal(padded.page_table[i, : used[i]], raw["page_table"][i, : used[i]])
            assert not padded.page_table[i, used[i] :].any()
        assert not padded.slot_indices[n:].any() and not padded.page_table[n:].any()
        assert not padded.input_ids[n:].any() and bool((padded.seq_lens[n:] == PAD_SEQ_LEN).all())
        _check_block_layout(padded.page_table, padded.seq_lens, padded.slot_indices, n, page_size, blocks)


def _check_block_layout(
    table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, n: int, page_size: int, blocks: int
) -> None:
    """Rebuild the page table and seq_lens from the flattened layout."""
    meta = build_block_metadata(table, seq_lens, page_size, blocks)
    bs = table.shape[0]
    assert meta.block_list.shape == meta.block_groups.shape == meta.block_usage.shape == (blocks,)
    assert meta.block_usage.dtype == torch.int32 and meta.block_groups.dtype == meta.block_list.dtype == torch.int64
    mapping = block_mapping(meta.block_groups, bs, torch.float32)  # what the step builds on the device
    assert mapping.shape == (blocks, bs)
    real = meta.block_groups < bs
    assert not mapping[~real].any() and bool((meta.block_groups[~real] == bs).all())
    assert torch.equal(mapping[real].argmax(1), meta.block_groups[real])
    assert torch.equal(mapping.sum(1), real.float())
    one_hot = torch.nn.functional.one_hot(meta.block_groups, bs + 1)[:, :bs].float()  # the host-side construction
    assert torch.equal(mapping, one_hot)
    for row in range(bs):
        mine = meta.block_groups == row
        pages = meta.block_list[mine]
        assert torch.equal(pages.to(torch.int32), table[row, : pages.numel()])
        usage = meta.block_usage[mine]
        assert bool((usage[:-1] == page_size).all())
        assert (pages.numel() - 1) * page_size + int(usage[-1]) == int(seq_lens[row])
        if row < n:  # SGLang computes the last block's usage from the slot: same number
            assert int(usage[-1]) == int(slots[row]) % page_size + 1


def test_overflow_is_a_clear_error() -> None:
    buckets = decode_buckets([1, 2], [2, 4], max_blocks_per_seq=2)
    with pytest.raises(BucketOverflowError, match="fits no bucket"):
        choose_decode_bucket(torch.tensor([8, 8, 8], dtype=torch.int32), 4, buckets)


def test_warmup_batches_land_exactly_on_their_bucket() -> None:
    with open(os.path.join(CONFIG_DIR, "hpu.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    resolved = resolve_bucket_config(config, env={})
    buckets = resolved.decode_pairs()
    for bucket in buckets:
        batch = warmup_batch(bucket, resolved.page_size, resolved.max_blocks_per_seq)
        assert choose_decode_bucket(batch.seq_lens, resolved.page_size, buckets) == bucket
        assert not batch.page_table.any() and not batch.slot_indices.any()  # dummy page and slot only
        assert tuple(batch.page_table.shape) == expected_shapes(bucket, resolved.max_blocks_per_seq)["page_table"]


def test_config_and_env_overrides() -> None:
    with open(os.path.join(CONFIG_DIR, "hpu.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    for key in (
        "page_size",
        "dtype",
        "capture_sizes",
        "max_capture_size",
        "max_num_seqs",
        "max_model_len",
        "kv_cache_memory_fraction",
    ):
        assert key in config
    assert config["page_size"] == 128 and config["dtype"] == "bfloat16"
    plain = resolve_bucket_config(config, env={})
    assert config["capture_sizes"] == linear_buckets(BucketRange(**config["hpu"]["decode_bs_bucket"]))
    assert plain.decode_bs == config["capture_sizes"] and plain.max_blocks_per_seq == 4096 // 128
    assert plain.decode_block == linear_buckets(BucketRange(128, 128, 2560))
    env = {
        "ENGINE_DECODE_BS_BUCKET_MIN": "2",
        "ENGINE_DECODE_BS_BUCKET_STEP": "8",
        "ENGINE_DECODE_BS_BUCKET_MAX": "32",
        "ENGINE_DECODE_BLOCK_BUCKET_MAX": "512",
        "ENGINE_PROMPT_SEQ_BUCKET_STEP": "1024",
    }
    over = resolve_bucket_config(config, env=env)
    assert over.decode_bs == [2, 4, 8, 16, 24, 32] and over.decode_block == [128, 256, 384, 512]
    assert over.prompt_seq == [128, 256, 512, 1024, 2048, 3072, 4096]
    expo = resolve_bucket_config({**config, "hpu": {**config["hpu"], "bucketing": "exponential"}}, env={})
    assert expo.strategy == "exponential" and len(expo.decode_block) < len(plain.decode_block)


def _step_with_scale(state: dict[str, int]) -> Any:
    def step(input_ids, positions, slot_indices, page_table, seq_lens):
        row = input_ids * 1000 + seq_lens.to(torch.int64) + page_table.to(torch.int64).sum(1) + slot_indices
        return (row * state["scale"]).to(torch.float32).unsqueeze(1).repeat(1, 3)

    return step


def test_runner_on_cpu_pads_slices_and_is_strict() -> None:
    reset_dynamo()
    state = {"scale": 1}
    step = _step_with_scale(state)
    page_size, max_pages = 4, 4
    buckets = decode_buckets([1, 2, 4], [2, 4, 8, 16], max_pages)
    dynamo_config_before = torch._dynamo.config.get_config_copy()
    runner = HpuDecodeRunner(
        step,
        buckets=buckets,
        page_size=page_size,
        max_blocks_per_seq=max_pages,
        device="cpu",
        mode="compile",
        compile_backend="eager",
        show_progress=False,
    )
    runner.warmup()
    shapes = {runner.shape_key(b) for b in buckets}  # (2, 4) and (2, 8) share page-table width 4
    assert len(shapes) == 5 and runner.warmed == set(buckets)
    assert runner.dynamo_compiles == len(shapes)  # one compile per distinct shape, none on the repeat run
    # More buckets than dynamo's default limit would allow, yet the process-wide config is untouched.
    assert torch._dynamo.config.get_config_copy() == dynamo_config_before
    rng = random.Random(7)
    for _ in range(20):
        raw = _random_batch(rng, rng.randint(1, 4), page_size, max_pages, width=max_pages)
        logits = runner.run(**raw)
        assert torch.equal(logits, step(**raw))  # padded rows sliced away, real rows untouched
    assert runner.dynamo_compiles == len(shapes)  # serving compiled nothing
    state["scale"] = 2  # the step now guards on a changed Python value: a recompile after warm-up
    with pytest.raises(RecompileAfterWarmupError):
        runner.run(**_random_batch(rng, 1, page_size, max_pages, width=max_pages))


def test_shape_guarantee_rejects_unwarmed_shapes() -> None:
    batch = warmup_batch((2, 4), page_size=4, max_blocks_per_seq=4)
    check_static_shapes(batch, {(2, 4)}, 4)
    with pytest.raises(ShapeGuaranteeError, match="not warmed"):
        check_static_shapes(batch, {(2, 8)}, 4)
    batch.page_table = batch.page_table[:, :3]
    with pytest.raises(ShapeGuaranteeError, match="page_table"):
        check_static_shapes(batch, {(2, 4)}, 4)


@pytest.mark.absent("hpu")  # asserts the vendor stack is missing: never on its runner
def test_platform_without_gaudi(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = HpuPlatform()
    assert platform.name == "hpu" and platform.device_type == "hpu" and platform.dist_backend == "hccl"
    assert not platform.is_available()
    assert "habana_frameworks" in platform.unavailable_reason()
    with pytest.raises(DeviceUnavailableError, match="habana_frameworks"):
        platform.memory_info()
    assert os.path.exists(platform.default_config())
    settings = HpuPlatform(graph_mode="compile").capture_settings()
    assert (settings.kind, settings.compile_backend) == (CaptureKind.COMPILE, "hpu_backend")
    assert settings.compile_options["dynamic"] is False
    settings = HpuPlatform(graph_mode="lazy").capture_settings()
    assert settings.kind is CaptureKind.HPU_GRAPH and settings.compile_options["disable_tensor_cache"]
    assert resolve_graph_mode(env={"PT_HPU_LAZY_MODE": "1"}) == "lazy"
    assert resolve_graph_mode(env={"PT_HPU_LAZY_MODE": "0"}) == "compile"
    assert resolve_graph_mode("eager", env={"PT_HPU_LAZY_MODE": "1"}) == "eager"  # the config beats the bridge's
    assert resolve_graph_mode(bridge_lazy=False, env={"PT_HPU_LAZY_MODE": "1"}) == "compile"  # the bridge knows best
    # The engine's config (hpu.graph_mode, here from --device-options) reaches the platform through configure().
    lazy = EngineConfig(device="hpu", device_options={"hpu": {"graph_mode": "lazy"}}).resolve(platform)
    platform.configure(lazy)
    assert platform.graph_mode() == "lazy" and platform.capture_settings().kind is CaptureKind.HPU_GRAPH
    assert HpuPlatform(graph_mode="eager").capture_settings().kind is CaptureKind.NONE
    with pytest.raises(ValueError):
        resolve_graph_mode("fast")
    cache = torch.zeros(16, 2, 3)
    k = torch.randn(3, 2, 3)
    platform.store_kv(cache, cache.clone(), torch.tensor([5, 0, 9]), k, k)
    assert torch.equal(cache[[5, 0, 9]], k) and cache.abs().sum(dim=(1, 2)).count_nonzero() == 3


@pytest.mark.absent("hpu")  # asserts the vendor stack is missing: never on its runner
def test_import_does_not_load_habana() -> None:
    """Fresh imports of every backends.hpu module must not touch habana_frameworks."""
    saved = {name: mod for name, mod in sys.modules.items() if name.startswith("backends.hpu")}
    seen: list[str] = []

    class Spy:
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name.split(".")[0] == "habana_frameworks":
                seen.append(name)
            return None

    spy = Spy()
    sys.meta_path.insert(0, spy)
    try:
        for name in saved:
            del sys.modules[name]
        for name in (
            "backends.hpu",
            "backends.hpu.platform",
            "backends.hpu.bucketing",
            "backends.hpu.graph_runner",
            "backends.hpu.attention",
            "backends.hpu.prompt_attention",
            "backends.hpu.prefill",
            "backends.hpu.prefill_runner",
        ):
            importlib.import_module(name)
    finally:
        sys.meta_path.remove(spy)
        sys.modules.update(saved)  # keep the class objects the rest of the suite imported
    assert seen == [] and not any(m.startswith("habana_frameworks") for m in sys.modules)


class FakeModel:
    """The engine model's calling contract: model(ids, pos, kv_caches, meta) -> hidden; compute_logits(hidden)."""

    attention_backend = None  # the runner's own hooks (an engine model has its backend's)

    def __call__(self, input_ids, positions, kv_caches, meta):
        k_cache, _ = kv_caches[0]
        k_cache.index_copy_(0, meta.slot_indices.long(), input_ids.float().view(-1, 1, 1).expand(-1, 1, 2))
        used = torch.arange(meta.page_table.shape[1])[None, :] < ((meta.seq_lens.long() + 3) // 4)[:, None]
        pages = meta.page_table.long() * used
        return (input_ids * 1000 + meta.seq_lens.long() * 10 + positions + pages.sum(1)).float().unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.repeat(1, 4)


def test_engine_adapter_pads_to_slot_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.hpu.platform import HpuEngineRunner
    from engine.layers.attention import AttentionMetadata

    assert HpuPlatform().graph_runner_class() is HpuEngineRunner
    model, page_size, max_pages = FakeModel(), 4, 8
    kv = [(torch.zeros(40 * page_size, 1, 2), torch.zeros(40 * page_size, 1, 2))]
    # Eager: no compile here, the wiring is under test.
    eager = hpu_device_config(graph_mode="eager")
    runner = HpuEngineRunner(
        model, kv, [1, 2, 4], max_pages, page_size, torch.device("cpu"), show_progress=False, device_config=eager
    )
    runner.capture()
    assert runner.fits(4) and not runner.fits(5) and runner.inner.warmed == set(runner.inner.buckets)
    kv[0][0].zero_()
    rng = random.Random(5)
    raw = _random_batch(rng, 3, page_size, max_pages, width=max_pages)
    raw["page_table"] = raw["page_table"] % 39 + 1  # pages inside the pool
    raw["slot_indices"] = torch.tensor([12, 57, 130])
    meta = AttentionMetadata(
        is_decode=True,
        slot_indices=raw["slot_indices"],
        page_table=raw["page_table"],
        seq_lens=raw["seq_lens"],
        page_size=page_size,
    )
    logits = runner.run_batch(raw["input_ids"], raw["positions"], meta)
    expected = model.compute_logits(model(raw["input_ids"], raw["positions"], [(kv[0][0].clone(), None)], meta))
    assert torch.equal(logits, expected)
    written = kv[0][0].abs().sum(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [12, 57, 130]  # the padded row wrote slot 0 with id 0: nothing else touched


def test_runner_passes_block_metadata_with_bucket_length() -> None:
    seen: list[dict[str, tuple[int, ...]]] = []

    def step(input_ids, positions, slot_indices, page_table, seq_lens, **blocks):
        seen.append({name: tuple(t.shape) for name, t in blocks.items()})
        return input_ids.float().unsqueeze(1)

    buckets = decode_buckets([1, 2], [2, 4, 8], max_blocks_per_seq=4)
    runner = HpuDecodeRunner(
        step,
        buckets=buckets,
        page_size=4,
        max_blocks_per_seq=4,
        device="cpu",
        mode="eager",
        with_block_metadata=True,
        show_progress=False,
    )
    runner.warmup()
    assert len(seen) == 2 * len(buckets)  # blocks is a shape dimension now: every bucket warms up
    out = runner.run(
        torch.tensor([9]), torch.tensor([5]), torch.tensor([22]), torch.tensor([[5, 3]]), torch.tensor([6])
    )
    assert out.tolist() == [[9.0]]
    assert seen[-1] == {"block_list": (2,), "block_groups": (2,), "block_usage": (2,)}  # no [blocks, bs] matrix
    with pytest.raises(ValueError, match="columns"):
        pad_decode_batch(
            torch.zeros(1),
            torch.zeros(1),
            torch.zeros(1),
            torch.tensor([[5]]),
            torch.tensor([6]),
            (1, 2),
            page_size=4,
            max_blocks_per_seq=4,
        )


def test_prompt_buckets_with_context_pages() -> None:
    # Kept: a full row fits the model (seq + (ctx - 1) pages < max_model_len) and the batch budget, keys included.
    triples = prompt_ctx_buckets([1, 2], [128, 256], [0, 1, 2, 4], 128, max_model_len=640, max_num_batched_tokens=700)
    assert triples == [(1, 128, 1), (1, 128, 2), (1, 128, 4), (1, 256, 1), (1, 256, 2), (2, 128, 1)]
    # A budget keeps those with the fewest padded tokens (rows * (seq + ctx * page_size)).
    assert prompt_ctx_buckets([1], [128, 256], [1, 2, 4], 128, limit=3) == [(1, 128, 1), (1, 128, 2), (1, 256, 1)]
    assert choose_prompt_ctx_bucket(1, 100, 2, triples, 128) == (1, 128, 2)
    assert choose_prompt_ctx_bucket(2, 100, 1, triples, 128) == (2, 128, 1)
    assert choose_prompt_ctx_bucket(1, 129, 3, [(1, 256, 4), (1, 512, 4), (2, 256, 4)], 128) == (1, 256, 4)
    with pytest.raises(BucketOverflowError, match="prompt bucket with context"):
        choose_prompt_ctx_bucket(1, 100, 5, triples, 128)


def test_context_bucket_config_and_env() -> None:
    with open(os.path.join(CONFIG_DIR, "hpu.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    plain = resolve_bucket_config(config, env={})
    assert plain.prompt_ctx == linear_buckets(BucketRange(**config["hpu"]["prompt_ctx_bucket"]))
    triples = plain.prompt_ctx_triples(config["max_model_len"] - 1)
    assert len(triples) == config["hpu"]["max_prompt_ctx_buckets"] and all(c >= 1 for _, _, c in triples)
    assert all(bs * (seq + ctx * 128) <= config["hpu"]["max_num_batched_tokens"] for bs, seq, ctx in triples)
    env = {
        "ENGINE_PROMPT_CTX_BUCKET_MIN": "2",
        "ENGINE_PROMPT_CTX_BUCKET_STEP": "2",
        "ENGINE_PROMPT_CTX_BUCKET_MAX": "6",
    }
    over = resolve_bucket_config({**config, "hpu": {**config["hpu"], "max_prompt_ctx_buckets": 5}}, env=env)
    assert over.prompt_ctx == [2, 4, 6] and len(over.prompt_ctx_triples()) == 5
    assert resolve_bucket_config(config, env={"ENGINE_PROMPT_CTX_BUCKET_MAX": "0"}).prompt_ctx_triples() == []
    # A config written before context buckets existed keeps steps with a prefix unpadded.
    old = {**config, "hpu": {k: v for k, v in config["hpu"].items() if k != "prompt_ctx_bucket"}}
    assert resolve_bucket_config(old, env={}).prompt_ctx == []
