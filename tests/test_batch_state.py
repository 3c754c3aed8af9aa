"""The persistent decode rows: device table and host mirror stay equal under diffs, joins and leaves."""

from __future__ import annotations

import random

import pytest
import torch

from engine.batch_state import PENDING_TOKEN, DecodeBatchState
from engine.request import Request
from engine.sampling_params import SamplingParams


def test_host_mirror_and_host_batches_match_the_device_rows() -> None:
    """Requests grow page by page, leave and are replaced; a host-side batch (HPU's) equals the device one."""
    rng = random.Random(0)
    page_size, max_pages = 4, 16
    pages: dict[str, list[int]] = {}
    state = DecodeBatchState(8, max_pages, page_size, torch.device("cpu"), torch.int64,
                             lambda r: ([], pages[r.request_id]), mirror_on_host=True)
    assert state.host_page_table is not state.page_table
    free_pages = list(range(1, 200))
    rng.shuffle(free_pages)
    live: list[Request] = []

    def leave(request: Request) -> None:
        state.release(request)
        free_pages.extend(pages.pop(request.request_id))  # a later request may get the same pages
        live.remove(request)

    for step in range(200):
        if len(live) < 6 and rng.random() < 0.3:
            request = Request(f"r{step}", [rng.randrange(100) for _ in range(rng.randint(1, 20))], SamplingParams())
            pages[request.request_id] = [free_pages.pop() for _ in range(-(-request.num_tokens // page_size))]
            live.append(request)
        if live and rng.random() < 0.1:
            leave(rng.choice(live))
        for request in live:
            request.output_token_ids.append(rng.randrange(100))
            if len(pages[request.request_id]) * page_size < request.num_tokens:
                pages[request.request_id].append(free_pages.pop())
        for request in [r for r in live if r.num_tokens >= max_pages * page_size]:
            leave(request)  # its row is full: it leaves, as at max_model_len
        if not live:
            continue
        device_batch = state.decode_batch(live)
        host_batch = state.decode_batch(live, on_host=True)
        for name in ("input_ids", "positions"):
            assert torch.equal(getattr(device_batch, name), getattr(host_batch, name))
        for name in ("slot_indices", "page_table", "seq_lens"):
            assert torch.equal(getattr(device_batch.meta, name), getattr(host_batch.meta, name)), name
        assert torch.equal(device_batch.decode_rows, host_batch.decode_rows)
        rows = device_batch.decode_rows
        assert torch.equal(state.page_table[rows], state.host_page_table[rows])


def test_a_host_batch_refuses_a_token_still_on_the_device() -> None:
    state = DecodeBatchState(2, 4, 4, torch.device("cpu"), torch.int64, lambda r: ([], [1, 2]), mirror_on_host=True)
    request = Request("r", [5, 6, 7], SamplingParams())
    request.num_pending_tokens = 1  # overlap scheduling: its last token was sampled, not yet read back
    assert state.host_inputs([request])[0, 0] == PENDING_TOKEN
    with pytest.raises(ValueError, match="overlap"):
        state.decode_batch([request], on_host=True)
