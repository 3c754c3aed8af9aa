"""The persistent decode rows: the step messages' diffs keep the device table equal to the host's, and a
host-side batch (HPU/NPU runners) equal to the device batch, under growth, joins and leaves."""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.step_message import PENDING_TOKEN, StepBuilder
from graphs.model_runner import DecodeBatchState


def test_host_mirror_and_host_batches_match_the_device_rows() -> None:
    """Requests grow page by page, leave and are replaced; a host-side batch (HPU's) equals the device one."""
    rng = random.Random(0)
    page_size, max_pages = 4, 16
    pages: dict[str, list[int]] = {}
    state = DecodeBatchState(8, max_pages, page_size, torch.device("cpu"), torch.int64)
    builder = StepBuilder(8, max_pages, page_size, torch.device("cpu"), lambda r: ([], pages[r.request_id]))
    assert builder.host_page_table is not state.page_table
    free_pages = list(range(1, 200))
    rng.shuffle(free_pages)
    live: list[Request] = []

    def leave(request: Request) -> None:
        builder.release(request)
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
        message = builder.decode_message(live)
        state.apply(message)
        device_batch = state.decode_batch(message, live)
        ids, positions, slots, table, lens = message.host_batch()
        assert torch.equal(device_batch.input_ids, ids) and torch.equal(device_batch.positions, positions)
        meta = device_batch.meta
        assert torch.equal(meta.slot_indices, slots) and torch.equal(meta.page_table, table)
        assert torch.equal(meta.seq_lens, lens)
        rows = device_batch.decode_rows
        assert torch.equal(state.page_table[rows], builder.host_page_table[rows])
        for request, row in zip(live, rows.tolist()):  # each row holds exactly its request's pages
            own = pages[request.request_id]
            assert state.page_table[row, : len(own)].tolist() == own


def test_a_host_batch_refuses_a_token_still_on_the_device() -> None:
    builder = StepBuilder(2, 4, 4, torch.device("cpu"), lambda r: ([], [1, 2]))
    request = Request("r", [5, 6, 7], SamplingParams())
    request.num_pending_tokens = 1  # overlap scheduling: its last token was sampled, not yet read back
    message = builder.decode_message([request])
    assert message.inputs[0, 0] == PENDING_TOKEN
    with pytest.raises(ValueError, match="overlap"):
        message.host_batch()


def test_a_message_that_fails_to_build_sends_its_pages_again() -> None:
    """A row too long for the table fails the message; the rows before it must not count their pages
    as sent, or the device would never get them."""
    pages = {"a": [3], "b": [4, 5, 6, 7, 8]}
    builder = StepBuilder(2, 4, 4, torch.device("cpu"), lambda r: ([], pages[r.request_id]))
    a, b = Request("a", [1, 2], SamplingParams()), Request("b", [1] * 18, SamplingParams())
    with pytest.raises(ValueError, match="rows hold 4"):
        builder.decode_message([a, b])
    message = builder.decode_message([a])
    assert message.page_diffs is not None and message.page_diffs[2].tolist() == [3]
