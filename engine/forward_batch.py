"""Build the one batch representation a step runs on: ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.attention import AttentionMetadata
from engine.request import Request
from engine.transfer import to_device as _to_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # [sampled] rows of the hidden states that are sampled; None: every row (decode)
    requests: list[Request]
    # Decode steps from the persistent state: each request's decode row (device), where its sampled
    # token is kept for the next step and its penalty state lives.
    decode_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.requests)


def slot_of(pages: list[int], position: int, page_size: int) -> int:
    return pages[position // page_size] * page_size + position % page_size


def build_forward_batch(
    requests: list[Request],
    is_decode: bool,
    pages_of: dict[str, list[int]],
    page_size: int,
    device: torch.device,
    slot_dtype: torch.dtype = torch.int64,
    extend_lens: list[int] | None = None,
    sample_mask: list[bool] | None = None,
) -> ForwardBatch:
    """Host-side lists first, then one transfer per tensor.

    Extend runs extend_lens[i] tokens of request i from its first uncached one (a chunk, or all
    of them); only requests in sample_mask get a row in logits_indices.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    width = max(len(pages_of[r.request_id]) for r in requests)
    page_rows: list[list[int]] = []
    for index, request in enumerate(requests):
        pages = pages_of[request.request_id]
        tokens = request.all_token_ids
        if is_decode:
            start, end = request.num_tokens - 1, request.num_tokens
        else:
            start = request.num_cached_tokens
            end = start + extend_lens[index] if extend_lens is not None else request.num_tokens
        for position in range(start, end):
            input_ids.append(tokens[position])
            positions.append(position)
            slots.append(slot_of(pages, position, page_size))
        seq_lens.append(end)
        query_start_loc.append(len(input_ids))
        if sample_mask is None or sample_mask[index]:
            logits_indices.append(len(input_ids) - 1)
        page_rows.append(pages + [0] * (width - len(pages)))

    def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        return _to_device(values, dtype, device)

    meta = AttentionMetadata(
        is_decode=is_decode,
        slot_indices=to_device(slots, slot_dtype),
        page_table=to_device(page_rows, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        page_size=page_size,
        query_start_loc=None if is_decode else query_start_loc,
        seq_lens_cpu=None if is_decode else seq_lens,
    )
    return ForwardBatch(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        meta=meta,
        logits_indices=to_device(logits_indices, torch.int64),
        requests=requests,
    )
