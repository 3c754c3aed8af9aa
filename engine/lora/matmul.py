"""The batched LoRA matmul: what a kernel for it must do, and the torch path every platform has.

A projection's slots are stacked as lora_a [S, K, in] and lora_b [S, K, out] (K = parts * max rank;
engine/lora/layers.py). For each token row t with slot s_t >= 0 the matmul adds (A[s_t] @ x_t) @ B[s_t] to
the base output; rows of slot -1 (the base model, a graph's padding) keep it. A platform with a kernel that
reads only each row's slot says so through `Platform.lora_kernels()` (CUDA: grouped Triton kernels that add
into the base output in place, backends/cuda/lora.py); the others run `DENSE_LORA` below, which returns a new
tensor.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class TokenSlots(NamedTuple):
    """A step's rows' adapters, as engine/lora/rows.py keeps them on the device."""

    slots: torch.Tensor  # [T] int64: each row's slot, -1 for none
    sorted_rows: torch.Tensor  # [max_tokens] int64: the rows grouped by slot (kept when `grouped`)
    group_starts: torch.Tensor  # [S + 2] int64: each group's start in sorted_rows, the base rows last


class LoRAKernels(Protocol):
    """One batched LoRA matmul for every projection; it must run inside the platform's captured graphs
    (static shapes, the slots read on the device, no host synchronisation)."""

    name: str
    grouped: bool  # reads TokenSlots.sorted_rows and group_starts (the host then computes them every step)

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
    ) -> torch.Tensor:
        """out [T, out] + each row's (x [T, in] @ lora_a[slot].T) @ lora_b[slot]; rows of slot -1: out's values.

        The result is either `out` itself, written in place, or a new tensor with `out` left as it was: the
        caller passes an `out` whose old values nothing else reads (the base projection's fresh output) and
        uses only the returned tensor. A kernel that writes in place never reads or writes the rows of slot -1
        (they keep out's bits); the torch paths add zeros to them."""
        ...


class DenseLoRA:
    """Every slot's columns for every row, the other slots' masked to zero: two matmuls of width S*K.

    On the CPU this is faster than gathering each row's matrices for the slot counts LoRA runs with (a
    gather copies K x in values per row and projection): 4-70x at 16-256 rows for 1-8 slots, and as fast at
    one row (benchmarks/lora.py --compare-cpu-paths, docs/lora.md); its shapes never depend on the mix."""

    name = "dense"
    grouped = False

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
    ) -> torch.Tensor:
        slots = rows.slots
        num_slots, width, in_features = lora_a.shape
        slot_ids = torch.arange(num_slots, dtype=slots.dtype, device=slots.device)
        mask = (slots.unsqueeze(1) == slot_ids).to(lora_a.dtype).repeat_interleave(width, dim=1)  # [T, S*K]
        low_rank = x.to(lora_a.dtype) @ lora_a.reshape(num_slots * width, in_features).t()
        return out + ((low_rank * mask) @ lora_b.reshape(num_slots * width, -1)).to(out.dtype)


class GatherLoRA:
    """Each row's own slot gathered (A[slot_t], B[slot_t]) and two batched matmuls: work per row independent
    of the number of slots, but a copy of both matrices per row. The reference the kernels are tested
    against, and the CPU path's alternative that benchmarks/lora.py --compare-cpu-paths times."""

    name = "gather"
    grouped = False

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
    ) -> torch.Tensor:
        slots = rows.slots
        live = (slots >= 0).to(lora_a.dtype).unsqueeze(1)
        index = slots.clamp(min=0)
        low_rank = torch.bmm(lora_a[index], x.to(lora_a.dtype).unsqueeze(2)).squeeze(2)  # [T, K]
        delta = torch.bmm(low_rank.unsqueeze(1), lora_b[index]).squeeze(1)  # [T, out]
        return out + (delta * live).to(out.dtype)


DENSE_LORA = DenseLoRA()
GATHER_LORA = GatherLoRA()
