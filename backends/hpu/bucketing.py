"""Shape buckets for Gaudi (vllm-gaudi style): generation, lookup, padding, block layout.

Gaudi's graph compiler emits one recipe per tensor shape, so every decode step is
padded to a (batch_size, num_blocks) *bucket* and every bucket is compiled once
during warm-up. Everything here is plain torch on the host, independent of
habana_frameworks, and tested on CPU.

"Blocks" are KV pages (vllm-gaudi's word): a decode batch needs
``sum(ceil(seq_len / page_size))`` of them, and each padded row needs one more
(it attends to the dummy page 0; see pad_decode_batch).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.capture_sizes import smallest_bucket_at_least

# Padded rows: write k/v to slot 0 (inside page 0, never handed out) and attend to
# exactly that one slot. seq_len 1 rather than 0 keeps every softmax non-empty, so
# padded rows cannot produce NaN in kernels that do not guard empty rows.
PAD_SLOT = 0
PAD_PAGE = 0
PAD_SEQ_LEN = 1
# Filler blocks past the real ones: usage 1 (not 0) so the per-block mask keeps one
# finite column; their block_mapping row is all zero, so they contribute nothing.
PAD_BLOCK_USAGE = 1


class BucketOverflowError(ValueError):
    """A value is larger than the largest bucket: the batch cannot be served by a warmed graph."""


@dataclass(frozen=True)
class BucketRange:
    """min / step / max of one bucketed dimension (VLLM_*_BUCKET_{MIN,STEP,MAX} semantics)."""

    min: int
    step: int
    max: int

    def __post_init__(self) -> None:
        if self.min < 1 or self.step < 1 or self.max < self.min:
            raise ValueError(f"invalid bucket range min={self.min} step={self.step} max={self.max}")


def linear_buckets(r: BucketRange) -> list[int]:
    """Double from min while below step, then every step up to max.

    (1, 32, 128) -> [1, 2, 4, 8, 16, 32, 64, 96, 128]. Unlike vllm-gaudi's
    warmup_range, min and max are always buckets: a max that is not a multiple of
    step would otherwise be silently unservable (cf. SGLang PR #21005).
    """
    sizes = {r.min, r.max}
    value = r.min
    while value < r.step and value <= r.max:
        sizes.add(value)
        value *= 2
    sizes.update(v for v in range(r.step, r.max + 1, r.step) if v >= r.min)
    return sorted(sizes)


def exponential_buckets(r: BucketRange, count: int | None = None) -> list[int]:
    """About log2(max)+1 buckets spaced geometrically from min to max, rounded up to step.

    (1, 1, 64) -> [1, 2, 4, 8, 16, 32, 64]. Duplicates after rounding collapse,
    so the result can be shorter than `count`.
    """
    if count is None:
        count = math.ceil(math.log2(r.max)) + 1 if r.max > 1 else 1
    if count <= 1 or r.max == r.min:
        return sorted({r.min, r.max})
    ratio = r.max / r.min
    sizes = {r.min, r.max}
    for i in range(1, count - 1):
        raw = r.min * ratio ** (i / (count - 1))
        # Subtract a hair before ceil: 64 ** (3/6) is 8.000000000000002 in floats.
        rounded = math.ceil(raw / r.step - 1e-9) * r.step
        sizes.add(min(max(rounded, r.min), r.max))
    return sorted(sizes)


def make_buckets(r: BucketRange, strategy: str) -> list[int]:
    if strategy == "linear":
        return linear_buckets(r)
    if strategy == "exponential":
        return exponential_buckets(r)
    raise ValueError(f"unknown bucketing strategy {strategy!r} (expected 'linear' or 'exponential')")


def decode_buckets(
    bs_buckets: Sequence[int],
    block_buckets: Sequence[int],
    max_blocks_per_seq: int,
    max_blocks_total: int | None = None,
) -> list[tuple[int, int]]:
    """Valid (batch_size, num_blocks) pairs, sorted.

    A pair is valid when bs <= blocks (one block per row at least) and
    blocks <= bs * max_blocks_per_seq (no row is longer than max_model_len).
    For each bs the cap min(bs * max_blocks_per_seq, max_blocks_total) is added
    as a bucket too, so every batch that fits in memory has a bucket of its own
    batch size (with block buckets starting at 128, bs=1 would have none).
    """
    pairs: set[tuple[int, int]] = set()
    for bs in bs_buckets:
        cap = bs * max_blocks_per_seq
        if max_blocks_total is not None:
            cap = min(cap, max_blocks_total)
        if cap < bs:
            continue
        pairs.update((bs, b) for b in block_buckets if bs <= b <= cap)
        pairs.add((bs, cap))
    return sorted(pairs)


def prompt_buckets(
    bs_buckets: Sequence[int], seq_buckets: Sequence[int], max_num_batched_tokens: int | None = None
) -> list[tuple[int, int]]:
    """(batch_size, seq_len) prefill buckets whose token count fits the batch budget."""
    return sorted(
        (bs, seq)
        for bs in bs_buckets
        for seq in seq_buckets
        if max_num_batched_tokens is None or bs * seq <= max_num_batched_tokens
    )


def prompt_ctx_buckets(
    bs_buckets: Sequence[int],
    seq_buckets: Sequence[int],
    ctx_buckets: Sequence[int],
    page_size: int,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    limit: int | None = None,
) -> list[tuple[int, int, int]]:
    """(rows, tokens per row, context pages per row) prefill buckets for steps with a cached prefix, sorted.

    vllm-gaudi's prompt buckets with prefix caching are 3-D the same way (bucketing/linear.py
    generate_prompt_buckets: `(bs, seq, ctx_blocks)`, ctx in KV pages per row). Kept: ctx >= 1 (ctx 0 is
    the plain 2-D bucket), a row that fills the bucket still fits the model (its prefix needs all ctx pages,
    so it is longer than (ctx - 1) pages: seq + (ctx - 1) * page_size < max_model_len), and the padded
    tokens the attention holds, context included, fit the batch budget (rows * (seq + ctx * page_size) <=
    max_num_batched_tokens, vllm-gaudi's filter). limit: at most that many, those with the fewest padded
    tokens (every one is compiled at warm-up; a prefix past them runs unpadded).
    """
    triples = [
        (bs, seq, ctx)
        for bs in bs_buckets
        for seq in seq_buckets
        for ctx in ctx_buckets
        if ctx >= 1
        and (max_model_len is None or seq + (ctx - 1) * page_size < max_model_len)
        and (max_num_batched_tokens is None or bs * (seq + ctx * page_size) <= max_num_batched_tokens)
    ]
    if limit is not None:
        triples = sorted(triples, key=lambda b: (b[0] * (b[1] + b[2] * page_size), b))[: max(limit, 0)]
    return sorted(triples)


def find_bucket(value: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= value; `buckets` sorted ascending. Raises BucketOverflowError past the max."""
    if not buckets:
        raise ValueError("no buckets configured")
    if value < 0:
        raise ValueError(f"cannot bucket a negative value ({value})")
    found = smallest_bucket_at_least(buckets, value)
    if found is None:
        raise BucketOverflowError(f"value {value} exceeds the largest bucket {buckets[-1]}")
    return found


def pages_needed(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """ceil(seq_len / page_size) per row, int64."""
    return (seq_lens.to(torch.int64) + page_size - 1) // page_size


def choose_decode_bucket(seq_lens: torch.Tensor, page_size: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The smallest warmed (bs, blocks) bucket that holds this batch plus its padded rows."""
    n = int(seq_lens.numel())
    real_blocks = int(pages_needed(seq_lens, page_size).sum()) if n else 0
    for bs in sorted({b for b, _ in buckets}):
        if bs < n:
            continue
        need = real_blocks + (bs - n)  # each padded row reads one block: the dummy page 0
        fitting = [blocks for b, blocks in buckets if b == bs and blocks >= need]
        if fitting:
            return bs, min(fitting)
    largest = max(buckets) if buckets else None
    raise BucketOverflowError(
        f"decode batch of {n} rows needing {real_blocks} blocks fits no bucket (largest {largest}); "
        "raise hpu.decode_bs_bucket / hpu.decode_block_bucket max (--hpu-decode-*-bucket)"
    )


def choose_prompt_bucket(num_rows: int, max_len: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The warmed (rows, tokens per row) prompt bucket that holds `num_rows` prompts of up to `max_len` tokens
    with the fewest padded tokens (fewer rows on a tie).

    vllm-gaudi's find_prompt_bucket takes the first bucket >= (rows, len) in tuple order, which over a full
    product of the two lists is the same choice; checking each dimension on its own also holds for a list
    that is not a product, where tuple order can hand back a bucket too short for the prompt.
    """
    fitting = [(bs * seq, bs, seq) for bs, seq in buckets if bs >= num_rows and seq >= max_len]
    if num_rows < 1 or not fitting:
        largest = max(buckets) if buckets else None
        raise BucketOverflowError(
            f"{num_rows} prompt(s) of up to {max_len} tokens fit no prompt bucket (largest {largest}); raise "
            "hpu.prompt_bs_bucket / hpu.prompt_seq_bucket max (--hpu-prompt-*-bucket)"
        )
    _, bs, seq = min(fitting)
    return bs, seq


def choose_prompt_ctx_bucket(
    num_rows: int, max_len: int, max_ctx_pages: int, buckets: Sequence[tuple[int, int, int]], page_size: int
) -> tuple[int, int, int]:
    """The warmed (rows, tokens per row, context pages per row) bucket that holds `num_rows` prompts of up to
    `max_len` new tokens after cached prefixes of up to `max_ctx_pages` pages, with the fewest padded tokens
    (keys included: rows * (seq + ctx * page_size)); each dimension checked on its own, as for 2-D buckets."""
    fitting = [
        (bs * (seq + ctx * page_size), bs, seq, ctx)
        for bs, seq, ctx in buckets
        if bs >= num_rows and seq >= max_len and ctx >= max_ctx_pages
    ]
    if num_rows < 1 or not fitting:
        largest = max(buckets) if buckets else None
        raise BucketOverflowError(
            f"{num_rows} prompt(s) of up to {max_len} new tokens after up to {max_ctx_pages} cached pages fit no "
            f"prompt bucket with context (largest {largest}); raise hpu.prompt_ctx_bucket max or "
            "hpu.max_prompt_ctx_buckets"
        )
    _, bs, seq, ctx = min(fitting)
    return bs, seq, ctx


def page_table_width(blocks_bucket: int, max_blocks_per_seq: int) -> int:
    """Columns of the padded page table: no row can need more than either bound."""
    return min(blocks_bucket, max_blocks_per_seq)


@dataclass
class PaddedDecodeBatch:
    """A decode batch padded to a bucket; row i < num_real is request i."""

    input_ids: torch.Tensor  # [bs]
    positions: torch.Tensor  # [bs]
    slot_indices: torch.Tensor  # [bs]
    page_table: torch.Tensor  # [bs, width] int32
    seq_lens: torch.Tensor  # [bs] int32
    num_real: int
    bucket: tuple[int, int]


def pad_decode_batch(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_indices: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    bucket: tuple[int, int],
    page_size: int,
    max_blocks_per_seq: int,
) -> PaddedDecodeBatch:
    """Pad to bucket (bs, blocks): padded rows write slot 0, read page 0, seq_len 1, id/pos 0.

    Page-table entries beyond each row's used pages are zeroed, so the padded
    table depends only on the batch, not on stale columns of the input.
    """
    bs, blocks = bucket
    n = int(seq_lens.numel())
    if n > bs:
        raise BucketOverflowError(f"batch of {n} does not fit bucket batch size {bs}")
    width = page_table_width(blocks, max_blocks_per_seq)
    used = pages_needed(seq_lens, page_size)
    if n and int(used.max()) > width:
        raise BucketOverflowError(f"a row needs {int(used.max())} pages; bucket {bucket} allows {width}")
    if n and int(used.max()) > page_table.shape[-1]:
        raise ValueError(f"page_table has {page_table.shape[-1]} columns but a row needs {int(used.max())} pages")
    device = seq_lens.device

    def pad_1d(t: torch.Tensor, fill: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((bs,), fill, dtype=dtype, device=device)
        out[:n] = t.reshape(-1)[:n].to(dtype)
        return out

    table = torch.full((bs, width), PAD_PAGE, dtype=torch.int32, device=device)
    cols = min(width, page_table.shape[1])
    if n:
        real = page_table[:n, :cols].to(torch.int32)
        keep = torch.arange(cols, device=device).unsqueeze(0) < used.unsqueeze(1)
        table[:n, :cols] = torch.where(keep, real, torch.zeros_like(real))
    return PaddedDecodeBatch(
        input_ids=pad_1d(input_ids, 0, input_ids.dtype),
        positions=pad_1d(positions, 0, positions.dtype),
        slot_indices=pad_1d(slot_indices, PAD_SLOT, slot_indices.dtype),
        page_table=table,
        seq_lens=pad_1d(seq_lens, PAD_SEQ_LEN, torch.int32),
        num_real=n,
        bucket=(bs, blocks),
    )


@dataclass
class HpuBlockMetadata:
    """Flattened paged-attention layout (vllm-gaudi's block_list / block_groups / block_usage).

    Row-major over the padded page table: the blocks of row 0, then row 1, ...;
    padded to the blocks bucket with filler blocks (page 0, group = bs, usage 1),
    so its length is a bucket dimension, not data. The [blocks, bs] one-hot
    block_mapping is not here: the step builds it on the device from block_groups
    (backends/hpu/attention.py block_mapping), as vllm-gaudi builds it in the model.
    """

    block_list: torch.Tensor  # [blocks] int64 page ids
    block_groups: torch.Tensor  # [blocks] int64 row of each block; bs for filler
    block_usage: torch.Tensor  # [blocks] int32 tokens used in each block (page_size except the last)


def build_block_metadata(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    blocks_bucket: int,
) -> HpuBlockMetadata:
    """Flatten a (padded) page table into the block-list layout, padded to `blocks_bucket` (on the host)."""
    bs = int(seq_lens.numel())
    used = pages_needed(seq_lens, page_size)
    width = page_table.shape[1]
    mask = torch.arange(width, device=page_table.device).unsqueeze(0) < used.unsqueeze(1)
    block_list = page_table.to(torch.int64)[mask]
    groups = torch.arange(bs, device=page_table.device).unsqueeze(1).expand(bs, width)[mask]
    is_last = (torch.arange(width, device=page_table.device).unsqueeze(0) == (used - 1).unsqueeze(1))[mask]
    last_usage = (seq_lens.to(torch.int64) - (used - 1) * page_size)[groups]
    usage = torch.where(is_last, last_usage, torch.full_like(last_usage, page_size))
    count = int(block_list.numel())
    if count > blocks_bucket:
        raise BucketOverflowError(f"{count} blocks do not fit the blocks bucket {blocks_bucket}")
    pad = blocks_bucket - count
    block_list = torch.cat([block_list, block_list.new_full((pad,), PAD_PAGE)])
    groups = torch.cat([groups, groups.new_full((pad,), bs)])
    usage = torch.cat([usage, usage.new_full((pad,), PAD_BLOCK_USAGE)])
    return HpuBlockMetadata(block_list, groups, usage.to(torch.int32))


# ---- configuration: the hpu: section (backends/hpu/settings.py); bucket ranges overridable from the
# environment for debugging (ENGINE_{NAME}_BUCKET_{MIN,STEP,MAX}, docs/configuration.md) ----------


@dataclass
class HpuBucketConfig:
    """Resolved bucket settings; see docs/hpu.md for every key and variable."""

    strategy: str
    decode_bs: list[int]
    decode_block: list[int]
    prompt_bs: list[int]
    prompt_seq: list[int]
    page_size: int
    max_blocks_per_seq: int
    max_num_batched_tokens: int | None
    prompt_ctx: list[int] = field(default_factory=list)  # context pages per row of prefix buckets; [] = none
    max_prompt_ctx_buckets: int | None = None  # warm-up budget for the (rows, seq, ctx) buckets

    def decode_pairs(self, max_blocks_total: int | None = None) -> list[tuple[int, int]]:
        return decode_buckets(self.decode_bs, self.decode_block, self.max_blocks_per_seq, max_blocks_total)

    def prompt_pairs(self, max_prompt_len: int | None = None) -> list[tuple[int, int]]:
        """Prompt buckets; with max_prompt_len, none longer than the first sequence bucket that holds such a
        prompt (the longer ones could never be chosen, and warm-up would compile them for nothing)."""
        seq = self.prompt_seq
        if max_prompt_len is not None:
            cap = smallest_bucket_at_least(seq, max_prompt_len)
            seq = [s for s in seq if cap is None or s <= cap]
        return prompt_buckets(self.prompt_bs, seq, self.max_num_batched_tokens)

    def prompt_ctx_triples(self, max_prompt_len: int | None = None) -> list[tuple[int, int, int]]:
        """Prompt buckets with a cached prefix, (rows, seq, ctx pages), over the sequence buckets prompt_pairs
        keeps; rows that fill one fit a context of max_prompt_len + 1 tokens (default: max_model_len)."""
        seq = sorted({s for _, s in self.prompt_pairs(max_prompt_len)})
        max_len = max_prompt_len + 1 if max_prompt_len is not None else self.max_blocks_per_seq * self.page_size
        return prompt_ctx_buckets(
            self.prompt_bs,
            seq,
            self.prompt_ctx,
            self.page_size,
            max_len,
            self.max_num_batched_tokens,
            self.max_prompt_ctx_buckets,
        )


def read_bucket_range(name: str, defaults: Mapping[str, int], env: Mapping[str, str]) -> tuple[BucketRange, bool]:
    """ENGINE_{NAME}_BUCKET_{MIN,STEP,MAX} (name like DECODE_BS) over `defaults`; and whether env set any."""
    raw = {part: env.get(f"ENGINE_{name}_BUCKET_{part}".upper(), "").strip() for part in ("min", "step", "max")}
    values = {part: int(text) if text else int(defaults[part]) for part, text in raw.items()}
    return BucketRange(values["min"], values["step"], values["max"]), any(raw.values())


def resolve_bucket_config(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> HpuBucketConfig:
    """Bucket lists from a configs/hpu.yaml-shaped mapping and the debugging bucket ranges of the environment.

    Precedence for decode batch sizes: ENGINE_DECODE_BS_BUCKET_* > the engine-wide
    `capture_sizes` list > hpu.decode_bs_bucket. Other ranges: env > hpu.*_bucket > defaults.
    """
    env = os.environ if env is None else env
    hpu = dict(config.get("hpu") or {})
    page_size = int(config.get("page_size", 128))
    max_model_len = int(config.get("max_model_len", 4096))
    max_num_seqs = int(config.get("max_num_seqs", 128))
    max_blocks_per_seq = math.ceil(max_model_len / page_size)
    strategy = hpu.get("bucketing") or "linear"
    defaults = {
        "decode_bs": {"min": 1, "step": 32, "max": max_num_seqs},
        "decode_block": {"min": 128, "step": 128, "max": max_num_seqs * max_blocks_per_seq},
        "prompt_bs": {"min": 1, "step": 1, "max": 1},
        "prompt_seq": {"min": page_size, "step": page_size, "max": max_model_len},
    }
    lists: dict[str, list[int]] = {}
    env_set: dict[str, bool] = {}
    for key, default in defaults.items():
        r, env_set[key] = read_bucket_range(key, {**default, **(hpu.get(f"{key}_bucket") or {})}, env)
        lists[key] = make_buckets(r, strategy)
    lists["prompt_ctx"] = read_ctx_buckets(hpu.get("prompt_ctx_bucket"), max_blocks_per_seq, strategy, env)
    if not env_set["decode_bs"] and config.get("capture_sizes"):
        lists["decode_bs"] = sorted({int(s) for s in config["capture_sizes"]})
    tokens = config.get("max_num_batched_tokens", hpu.get("max_num_batched_tokens"))
    ctx_limit = hpu.get("max_prompt_ctx_buckets")
    return HpuBucketConfig(
        strategy=strategy,
        page_size=page_size,
        max_blocks_per_seq=max_blocks_per_seq,
        max_num_batched_tokens=int(tokens) if tokens is not None else None,
        max_prompt_ctx_buckets=int(ctx_limit) if ctx_limit not in (None, "") else None,
        **lists,
    )


def read_ctx_buckets(
    configured: Mapping[str, int] | None, max_blocks_per_seq: int, strategy: str, env: Mapping[str, str]
) -> list[int]:
    """Context pages per row of the prefix buckets: ENGINE_PROMPT_CTX_BUCKET_{MIN,STEP,MAX} over
    hpu.prompt_ctx_bucket (default min 1, step 4, max the pages of max_model_len). A max of 0 turns them
    off (every step with a cached prefix runs unpadded, as before they existed); no entry in the config and
    no env variable: off too, so a config written before them keeps its behaviour."""
    raw = {part: env.get(f"ENGINE_PROMPT_CTX_BUCKET_{part}".upper(), "").strip() for part in ("min", "step", "max")}
    if configured is None and not any(raw.values()):
        return []
    defaults = {"min": 1, "step": 4, "max": max_blocks_per_seq, **(configured or {})}
    values = {part: int(text) if text else int(defaults[part]) for part, text in raw.items()}
    if values["max"] <= 0:
        return []
    return make_buckets(BucketRange(values["min"], values["step"], values["max"]), strategy)
