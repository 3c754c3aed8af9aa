"""A scheduled step as the other ranks receive it: the StepMessage, minus what only rank 0 has.

Rank 0 owns the requests; the other ranks never see one. What they need to
run the same forward is the step's kind and the host data of its message
(engine/step_message.py): the decode rows' [4, n] inputs and page-table diffs,
the prefill chunks' flat lists, the rows that sample, and which prompts want
their logprobs (their LM-head slices are collectives every rank must join).
Each rank keeps its own host page table from the diffs, as its device table,
so the message stays O(batch) per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from engine.scheduler import ScheduledStep
from engine.step_message import DecodeMessage, ExtendMessage, StepMessage
from engine.transfer import host_tensor


@dataclass
class WireStep:
    is_decode: bool
    num_decodes: int  # the leading decode rows of an extend step (a mixed step)
    any_sampled: bool  # an extend step with no sampled request (a chunk of a long prompt) makes no logits
    # Rank 0 samples after this forward and broadcasts the tokens (collectives.broadcast_sampled); False for
    # a logits-only probe (ModelRunner.logits).
    samples: bool
    decode_inputs: bytes | None  # [4, n] int64 (DecodeMessage.inputs)
    page_diffs: bytes | None  # [3, m] int64 (DecodeMessage.page_diffs)
    extend: ExtendMessage | None
    sample_rows: list[int]
    lora_slots: list[int] | None = None  # each token's LoRA slot (engine/lora/); None: LoRA is off


def _pack(tensor: torch.Tensor | None) -> bytes | None:
    return None if tensor is None else tensor.numpy().tobytes()


@overload
def _unpack(data: bytes, rows: int, device: torch.device) -> torch.Tensor: ...


@overload
def _unpack(data: bytes | None, rows: int, device: torch.device) -> torch.Tensor | None: ...


def _unpack(data: bytes | None, rows: int, device: torch.device) -> torch.Tensor | None:
    if data is None:
        return None
    values = torch.from_numpy(np.frombuffer(data, dtype=np.int64).reshape(rows, -1).copy())
    return host_tensor(values, torch.int64, device)  # pinned where the device is CUDA, as on rank 0


def encode_step(
    step: ScheduledStep, message: StepMessage, samples: bool, lora_slots: list[int] | None = None
) -> WireStep:
    decode = message.decode
    return WireStep(
        is_decode=step.is_decode,
        num_decodes=step.num_decodes,
        any_sampled=any(step.sample_mask),
        samples=samples,
        decode_inputs=_pack(decode.inputs) if decode is not None else None,
        page_diffs=_pack(decode.page_diffs) if decode is not None else None,
        extend=message.extend,
        sample_rows=message.sample_rows,
        lora_slots=lora_slots,
    )


def decode_step(
    wire: WireStep, host_page_table: torch.Tensor, device: torch.device
) -> tuple[ScheduledStep, StepMessage]:
    """The step (no Request objects: batches are sized from their metadata) and its message, on a rank > 0.
    host_page_table: this rank's host copy of the decode rows' pages, updated here from the diffs."""
    decode = None
    if wire.decode_inputs is not None:
        inputs = _unpack(wire.decode_inputs, 4, device)
        diffs = _unpack(wire.page_diffs, 3, device)
        if diffs is not None:
            host_page_table[diffs[0], diffs[1]] = diffs[2].to(torch.int32)
        decode = DecodeMessage(inputs, diffs, host_page_table)
    # sample_mask given explicitly (one flag): an empty one would be rebuilt from the (absent) requests.
    step = ScheduledStep(wire.is_decode, [], [], sample_mask=[wire.any_sampled], num_decodes=wire.num_decodes)
    return step, StepMessage(decode, wire.extend, wire.sample_rows)
