"""Build the one batch representation a step runs on: ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
        query_starts=None if is_decode else to_device(query_start_loc, torch.int32),
    )
    return ForwardBatch(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        meta=meta,
        logits_indices=to_device(logits_indices, torch.int64),
        requests=requests,
    )


def mixed_forward_batch(decode: ForwardBatch, extend: ForwardBatch, decode_seq_lens: list[int]) -> ForwardBatch:
    """One ragged step: the decode rows (from the persistent state) first, then the extend requests.

    decode_seq_lens: the decode rows' context lengths on the host (the ragged metadata's host
    side). Page tables are padded to the wider of the two; every tensor stays on the device.
    """
    d = decode.batch_size
    width = max(decode.meta.page_table.shape[1], extend.meta.page_table.shape[1])
    tables = [F.pad(t, (0, width - t.shape[1])) for t in (decode.meta.page_table, extend.meta.page_table)]
    assert extend.meta.query_start_loc is not None and extend.meta.seq_lens_cpu is not None
    query_start_loc = list(range(d)) + [d + start for start in extend.meta.query_start_loc]
    device = decode.input_ids.device
    meta = AttentionMetadata(
        is_decode=False,
        slot_indices=torch.cat([decode.meta.slot_indices, extend.meta.slot_indices]),
        page_table=torch.cat(tables),
        seq_lens=torch.cat([decode.meta.seq_lens, extend.meta.seq_lens]),
        page_size=extend.meta.page_size,
        query_start_loc=query_start_loc,
        seq_lens_cpu=decode_seq_lens + extend.meta.seq_lens_cpu,
        query_starts=_to_device(query_start_loc, torch.int32, device),
        num_decodes=d,
    )
    assert extend.logits_indices is not None
    return ForwardBatch(
        input_ids=torch.cat([decode.input_ids, extend.input_ids]),
        positions=torch.cat([decode.positions, extend.positions]),
        meta=meta,
        logits_indices=torch.cat([torch.arange(d, device=device), extend.logits_indices + d]),
        requests=decode.requests + extend.requests,
        decode_rows=decode.decode_rows,
    )
