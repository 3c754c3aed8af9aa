"""HPU prefill on the host: which prompts of an extend step share a padded batch, and the padding itself.

vllm-gaudi's 2-D prompt bucketing (hpu_model_runner.py `_extract_prefill_batch_contents`,
`_form_prefill_batch`): the step's prompts are taken in order and merged into one batch while the
batch still fits a prompt bucket (rows, tokens per row); a prompt that does not fit starts the next
batch, and each batch is one forward pass padded to its bucket. Each prompt is a row: its tokens,
then padding to the row length; rows past the step's prompts are all padding. Padded tokens get id 0,
position 0 and the dummy slot (PAD_SLOT: page 0 is never handed out, decode padding writes there too),
so they never touch a real page. Everything here is host-side Python on the extend message's lists:
nothing is copied back from the device.

Only prompts without a cached prefix are bucketed (every key a row attends to is its own new token);
a step with a prefix hit, a later chunk of a chunked prompt, a prompt past the largest bucket, or a
request asking for prompt logprobs (which need every token's hidden state) runs unpadded
(`unbucketable_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from backends.hpu.bucketing import PAD_SLOT, BucketOverflowError, choose_prompt_bucket
from engine.step_message import ExtendMessage

PAD_TOKEN = 0
PAD_POSITION = 0


@dataclass
class PromptRow:
    """One prompt of an extend message: its new tokens and whether its last token is sampled."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    sampled: bool


def prompt_rows(message: ExtendMessage) -> list[PromptRow]:
    """The message's requests as rows (its flat lists cut at query_start_loc)."""
    starts = message.query_start_loc
    sampled = set(message.logits_indices)
    return [
        PromptRow(message.input_ids[a:b], message.positions[a:b], message.slots[a:b], b - 1 in sampled)
        for a, b in zip(starts[:-1], starts[1:])
    ]


def unbucketable_reason(message: ExtendMessage, buckets: Sequence[tuple[int, int]]) -> str | None:
    """Why this extend step cannot run padded to prompt buckets, or None when it can. A few fixed texts (no
    per-step numbers), so that a caller can log each one once."""
    if message.prompt_logprob_requests:
        return "a request asks for prompt logprobs (every token's logits)"
    starts = message.query_start_loc
    for i, seq_len in enumerate(message.seq_lens):
        if seq_len != starts[i + 1] - starts[i]:
            return "a request has a cached prefix (a prefix-cache hit or a later chunk of a chunked prompt)"
    if not buckets:
        return "no prompt buckets are configured"
    largest = max(seq for _, seq in buckets)
    if any(b - a > largest for a, b in zip(starts[:-1], starts[1:])):
        return f"a prompt is longer than the largest prompt bucket ({largest} tokens)"
    return None


def group_prompts(lengths: Sequence[int], buckets: Sequence[tuple[int, int]]) -> list[tuple[range, tuple[int, int]]]:
    """Consecutive prompts merged while their batch fits a bucket: [(prompt indices, bucket)], in order.
    Raises BucketOverflowError when one prompt alone fits none."""
    groups: list[tuple[range, tuple[int, int]]] = []
    start = 0
    while start < len(lengths):
        bucket = choose_prompt_bucket(1, lengths[start], buckets)
        end = start + 1
        while end < len(lengths):
            try:
                bucket_with_next = choose_prompt_bucket(end - start + 1, max(lengths[start : end + 1]), buckets)
            except BucketOverflowError:
                break
            bucket, end = bucket_with_next, end + 1
        groups.append((range(start, end), bucket))
        start = end
    return groups


@dataclass
class PaddedPromptBatch:
    """Prompts padded to a bucket (rows, seq): row r < num_real is prompt r; tensors on the host."""

    input_ids: torch.Tensor  # [rows * seq] int64
    positions: torch.Tensor  # [rows * seq] int64
    slot_indices: torch.Tensor  # [rows * seq]; PAD_SLOT for every padded token
    seq_lens: torch.Tensor  # [rows] int32: tokens of each row, 0 for padded rows
    last_index: torch.Tensor  # [rows] int64: each row's last token in the flat batch (padded rows: their first)
    sampled_rows: list[int]  # rows whose logits the step returns, in order
    bucket: tuple[int, int]

    @property
    def num_real(self) -> int:
        return int((self.seq_lens > 0).sum())


STEP_INPUTS = ("input_ids", "positions", "slot_indices", "seq_lens", "last_index")  # the step's positional args


def pad_prompt_batch(
    rows: Sequence[PromptRow], bucket: tuple[int, int], slot_dtype: torch.dtype = torch.int64
) -> PaddedPromptBatch:
    """Pad rows to bucket (rows, seq): every row to seq tokens, then padded rows, all padding at the dummy slot."""
    bs, seq = bucket
    if len(rows) > bs or any(len(r.input_ids) > seq for r in rows):
        raise BucketOverflowError(f"{len(rows)} prompt(s) do not fit the prompt bucket {bucket}")
    input_ids = torch.full((bs, seq), PAD_TOKEN, dtype=torch.int64)
    positions = torch.full((bs, seq), PAD_POSITION, dtype=torch.int64)
    slots = torch.full((bs, seq), PAD_SLOT, dtype=slot_dtype)
    seq_lens = torch.zeros(bs, dtype=torch.int32)
    for r, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[r, :n] = torch.tensor(row.input_ids, dtype=torch.int64)
        positions[r, :n] = torch.tensor(row.positions, dtype=torch.int64)
        slots[r, :n] = torch.tensor(row.slots, dtype=slot_dtype)
        seq_lens[r] = n
    last_index = torch.arange(bs, dtype=torch.int64) * seq + (seq_lens.to(torch.int64) - 1).clamp(min=0)
    return PaddedPromptBatch(input_ids.view(-1), positions.view(-1), slots.view(-1), seq_lens, last_index,
                             [r for r, row in enumerate(rows) if row.sampled], bucket)  # fmt: skip


def warmup_prompt_batch(bucket: tuple[int, int], slot_dtype: torch.dtype = torch.int64) -> PaddedPromptBatch:
    """A full batch of `bucket` whose tokens all write the dummy slot: warm-up touches no real page."""
    bs, seq = bucket
    rows = [PromptRow([PAD_TOKEN] * seq, [PAD_POSITION] * seq, [PAD_SLOT] * seq, True) for _ in range(bs)]
    return pad_prompt_batch(rows, bucket, slot_dtype)
