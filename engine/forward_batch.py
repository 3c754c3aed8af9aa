"""Build the one batch representation a step runs on: ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionMetadata
from engine.request import Request
from engine.step_message import ExtendMessage, extend_message
from engine.transfer import to_device as _to_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    logits_indices: (
        torch.Tensor | None
    )  # [sampled] rows of the hidden states that are sampled; None: every row (decode)
    requests: list[Request]
    # Decode steps from the persistent state: each request's decode row (device), where its sampled
    # token is kept for the next step and its penalty state lives.
    decode_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Requests (rows) in the batch, from its metadata: a tensor-parallel rank > 0 runs batches
        without Request objects."""
        starts = self.meta.query_start_loc
        return len(starts) - 1 if starts is not None else int(self.meta.seq_lens.shape[0])


def extend_forward_batch(
    message: ExtendMessage,
    requests: list[Request],
    page_size: int,
    device: torch.device,
    slot_dtype: torch.dtype = torch.int64,
) -> ForwardBatch:
    """An extend message on the device: one transfer per tensor."""

    def to_device(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return _to_device(values, dtype, device)

    meta = AttentionMetadata(
        is_decode=False,
        slot_indices=to_device(message.slots, slot_dtype),
        page_table=to_device(message.page_rows, torch.int32),
        seq_lens=to_device(message.seq_lens, torch.int32),
        page_size=page_size,
        query_start_loc=message.query_start_loc,
        seq_lens_cpu=message.seq_lens,
        query_starts=to_device(message.query_start_loc, torch.int32),
    )
    return ForwardBatch(
        input_ids=to_device(message.input_ids, torch.int64),
        positions=to_device(message.positions, torch.int64),
        meta=meta,
        logits_indices=to_device(message.logits_indices, torch.int64),
        requests=requests,
    )


def build_forward_batch(
    requests: list[Request],
    pages_of: dict[str, list[int]],
    page_size: int,
    device: torch.device,
    slot_dtype: torch.dtype = torch.int64,
    extend_lens: list[int] | None = None,
    sample_mask: list[bool] | None = None,
) -> ForwardBatch:
    """An extend batch straight from requests and their pages (the message, then its transfer)."""
    message = extend_message(requests, pages_of, page_size, extend_lens, sample_mask)
    return extend_forward_batch(message, requests, page_size, device, slot_dtype)


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
