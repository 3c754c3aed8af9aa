"""HPU prefill on the host: which prompts of an extend step share a padded batch, and the padding itself.

vllm-gaudi's prompt bucketing (hpu_model_runner.py `_extract_prefill_batch_contents`,
`_form_prefill_batch`): the step's prompts are taken in order and merged into one batch while the
batch still fits a prompt bucket; a prompt that does not fit starts the next batch, and each batch is
one forward pass padded to its bucket. Each prompt is a row: its new tokens, then padding to the row
length; rows past the step's prompts are all padding. Padded tokens get id 0, position 0 and the dummy
slot (PAD_SLOT: page 0 is never handed out, decode padding writes there too), so they never touch a real
page. Everything here is host-side Python on the extend message's lists: nothing is copied back from
the device.

A batch without a cached prefix takes a 2-D bucket (rows, tokens per row). A batch where a request has
one (a prefix-cache hit, or a later chunk of a chunked prompt) takes a 3-D bucket (rows, tokens per row,
context pages per row), as vllm-gaudi's prompt buckets with prefix caching do: each row also carries its
prefix length and the page ids that hold it (from the message's page rows), padded with the dummy page 0
to the bucket's context pages; the attention gathers those pages on the device
(backends/hpu/prompt_attention.py). A step runs unpadded (`unbucketable_reason`) when a prompt fits no
bucket, or a request asks for prompt logprobs (which need every token's hidden state).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backends.hpu.bucketing import (
    PAD_PAGE,
    PAD_SLOT,
    BucketOverflowError,
    choose_prompt_bucket,
    choose_prompt_ctx_bucket,
)
from engine.step_message import ExtendMessage

PAD_TOKEN = 0
PAD_POSITION = 0

Bucket = tuple[int, ...]  # (rows, seq) or (rows, seq, ctx pages)

# unbucketable_reason's texts: fixed (no per-step numbers), so that a caller can log each one once.
REASON_PROMPT_LOGPROBS = "a request asks for prompt logprobs (every token's logits)"
REASON_NO_BUCKETS = "no prompt buckets are configured"
REASON_PREFIX_OFF = (
    "a request has a cached prefix (a prefix-cache hit or a later chunk of a chunked prompt) and no prompt bucket "
    "has context pages (hpu.prompt_ctx_bucket / ENGINE_PROMPT_CTX_BUCKET_MAX)"
)
REASON_PREFIX_TOO_LONG = (
    "a request's cached prefix and new tokens fit no prompt bucket with context pages (raise "
    "hpu.prompt_ctx_bucket.max, hpu.max_prompt_ctx_buckets or hpu.max_num_batched_tokens)"
)


@dataclass
class PromptRow:
    """One prompt of an extend message: its new tokens, whether its last token is sampled, and its cached
    prefix (tokens before the first new one, and the request's page ids, which hold it first)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    sampled: bool
    prefix_len: int = 0
    pages: list[int] = field(default_factory=list)

    def ctx_pages(self, page_size: int) -> int:
        """KV pages its prefix spans (the last one partly, when the prefix ends mid-page)."""
        return -(-self.prefix_len // page_size)


def prompt_rows(message: ExtendMessage) -> list[PromptRow]:
    """The message's requests as rows (its flat lists cut at query_start_loc)."""
    starts = message.query_start_loc
    sampled = set(message.logits_indices)
    return [
        PromptRow(
            message.input_ids[a:b],
            message.positions[a:b],
            message.slots[a:b],
            b - 1 in sampled,
            message.seq_lens[i] - (b - a),
            list(message.page_rows[i]) if message.page_rows else [],
        )
        for i, (a, b) in enumerate(itertools.pairwise(starts))
    ]


def unbucketable_reason(
    message: ExtendMessage,
    buckets: Sequence[tuple[int, int]],
    ctx_buckets: Sequence[tuple[int, int, int]] = (),
    page_size: int = 0,
) -> str | None:
    """Why this extend step cannot run padded to prompt buckets, or None when it can. One of a few fixed
    texts (no per-step numbers), so that a caller can log each one once. ctx_buckets (with page_size): the
    (rows, seq, ctx pages) buckets for requests with a cached prefix; without them such a step is refused."""
    if message.prompt_logprob_requests:
        return REASON_PROMPT_LOGPROBS
    starts = message.query_start_loc
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    prefixes = [seq_len - n for seq_len, n in zip(message.seq_lens, lengths)]
    if any(prefixes) and (not ctx_buckets or page_size < 1):
        return REASON_PREFIX_OFF
    if not buckets and not ctx_buckets:
        return REASON_NO_BUCKETS
    largest = max((seq for _, seq in buckets), default=0)
    for n, prefix in zip(lengths, prefixes):
        if prefix:
            try:
                choose_prompt_ctx_bucket(1, n, -(-prefix // page_size), ctx_buckets, page_size)
            except BucketOverflowError:
                return REASON_PREFIX_TOO_LONG
        elif n > largest:
            return f"a prompt is longer than the largest prompt bucket ({largest} tokens)"
    return None


def choose_bucket(
    lengths: Sequence[int],
    ctx: Sequence[int],
    buckets: Sequence[tuple[int, int]],
    ctx_buckets: Sequence[tuple[int, int, int]] = (),
    page_size: int = 0,
) -> Bucket:
    """The bucket of one batch of prompts (their new-token counts and prefix pages): 2-D when none has a
    prefix, else 3-D. Raises BucketOverflowError when none holds them."""
    if not any(ctx):
        return choose_prompt_bucket(len(lengths), max(lengths), buckets)
    return choose_prompt_ctx_bucket(len(lengths), max(lengths), max(ctx), ctx_buckets, page_size)


def group_prompts(
    lengths: Sequence[int],
    buckets: Sequence[tuple[int, int]],
    ctx: Sequence[int] | None = None,
    ctx_buckets: Sequence[tuple[int, int, int]] = (),
    page_size: int = 0,
) -> list[tuple[range, Bucket]]:
    """Consecutive prompts merged while their batch fits a bucket: [(prompt indices, bucket)], in order.
    ctx: each prompt's prefix pages (default none). Raises BucketOverflowError when one prompt alone fits none."""
    ctx = list(ctx) if ctx is not None else [0] * len(lengths)
    groups: list[tuple[range, Bucket]] = []
    start = 0
    while start < len(lengths):
        bucket = choose_bucket(lengths[start : start + 1], ctx[start : start + 1], buckets, ctx_buckets, page_size)
        end = start + 1
        while end < len(lengths):
            try:
                wider = choose_bucket(lengths[start : end + 1], ctx[start : end + 1], buckets, ctx_buckets, page_size)
            except BucketOverflowError:
                break
            bucket, end = wider, end + 1
        groups.append((range(start, end), bucket))
        start = end
    return groups


@dataclass
class PaddedPromptBatch:
    """Prompts padded to a bucket (rows, seq[, ctx]): row r < num_real is prompt r; tensors on the host."""

    input_ids: torch.Tensor  # [rows * seq] int64
    positions: torch.Tensor  # [rows * seq] int64
    slot_indices: torch.Tensor  # [rows * seq]; PAD_SLOT for every padded token
    seq_lens: torch.Tensor  # [rows] int32: tokens of each row, 0 for padded rows
    last_index: torch.Tensor  # [rows] int64: each row's last token in the flat batch (padded rows: their first)
    sampled_rows: list[int]  # rows whose logits the step returns, in order
    bucket: Bucket
    ctx_lens: torch.Tensor | None = None  # [rows] int32: each row's cached prefix tokens (3-D buckets only)
    ctx_pages: torch.Tensor | None = None  # [rows, ctx] int64: the pages holding them, then PAD_PAGE

    @property
    def num_real(self) -> int:
        return int((self.seq_lens > 0).sum())

    def step_inputs(self) -> list[torch.Tensor]:
        """The step's positional arguments (STEP_INPUTS, then the prefix's two for a 3-D bucket)."""
        inputs = [getattr(self, name) for name in STEP_INPUTS]
        if self.ctx_pages is not None:
            assert self.ctx_lens is not None
            inputs += [self.ctx_lens, self.ctx_pages]
        return inputs


STEP_INPUTS = ("input_ids", "positions", "slot_indices", "seq_lens", "last_index")  # the step's positional args


def pad_prompt_batch(
    rows: Sequence[PromptRow], bucket: Bucket, slot_dtype: torch.dtype = torch.int64, page_size: int = 0
) -> PaddedPromptBatch:
    """Pad rows to bucket (rows, seq[, ctx]): every row to seq tokens, then padded rows, all padding at the dummy
    slot. A 3-D bucket (page_size needed) also pads each row's prefix pages to ctx with the dummy page."""
    bs, seq = bucket[0], bucket[1]
    ctx = bucket[2] if len(bucket) > 2 else None
    if len(rows) > bs or any(len(r.input_ids) > seq for r in rows):
        raise BucketOverflowError(f"{len(rows)} prompt(s) do not fit the prompt bucket {bucket}")
    if ctx is None and any(r.prefix_len for r in rows):
        raise ValueError(f"a prompt with a cached prefix needs a bucket with context pages, not {bucket}")
    if ctx is not None and (page_size < 1 or any(r.ctx_pages(page_size) > ctx for r in rows)):
        raise BucketOverflowError(f"a cached prefix does not fit the {ctx} context pages of bucket {bucket}")
    input_ids = torch.full((bs, seq), PAD_TOKEN, dtype=torch.int64)
    positions = torch.full((bs, seq), PAD_POSITION, dtype=torch.int64)
    slots = torch.full((bs, seq), PAD_SLOT, dtype=slot_dtype)
    seq_lens = torch.zeros(bs, dtype=torch.int32)
    ctx_lens = torch.zeros(bs, dtype=torch.int32) if ctx is not None else None
    ctx_pages = torch.full((bs, ctx), PAD_PAGE, dtype=torch.int64) if ctx is not None else None
    for r, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[r, :n] = torch.tensor(row.input_ids, dtype=torch.int64)
        positions[r, :n] = torch.tensor(row.positions, dtype=torch.int64)
        slots[r, :n] = torch.tensor(row.slots, dtype=slot_dtype)
        seq_lens[r] = n
        if ctx_pages is not None and ctx_lens is not None and row.prefix_len:
            used = row.ctx_pages(page_size)
            if len(row.pages) < used:
                raise ValueError(f"a prefix of {row.prefix_len} tokens needs {used} pages, not {len(row.pages)}")
            ctx_pages[r, :used] = torch.tensor(row.pages[:used], dtype=torch.int64)
            ctx_lens[r] = row.prefix_len
    last_index = torch.arange(bs, dtype=torch.int64) * seq + (seq_lens.to(torch.int64) - 1).clamp(min=0)
    sampled = [r for r, row in enumerate(rows) if row.sampled]
    return PaddedPromptBatch(
        input_ids.view(-1),
        positions.view(-1),
        slots.view(-1),
        seq_lens,
        last_index,
        sampled,
        tuple(bucket),
        ctx_lens,
        ctx_pages,
    )


def warmup_prompt_batch(bucket: Bucket, slot_dtype: torch.dtype = torch.int64, page_size: int = 0) -> PaddedPromptBatch:
    """A full batch of `bucket` whose tokens all write the dummy slot (and, for a 3-D bucket, whose prefixes
    are empty and read only the dummy page): warm-up touches no real page."""
    bs, seq = bucket[0], bucket[1]
    rows = [PromptRow([PAD_TOKEN] * seq, [PAD_POSITION] * seq, [PAD_SLOT] * seq, True) for _ in range(bs)]
    return pad_prompt_batch(rows, bucket, slot_dtype, page_size)
