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
    """The batched LoRA matmul for every projection; it must run inside the platform's captured graphs
    (static shapes, the slots read on the device, no host synchronisation). Two entry points: `apply`, the whole
    product from x, and `expand`, its second half, for a projection whose base matmul already computed every
    slot's low-rank columns (A folded into the base weight: engine/lora/layers.py)."""

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

    def expand(self, out: torch.Tensor, low_rank: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots) -> torch.Tensor:
        """out [T, out] + each row's low_rank[t, slot*K : (slot+1)*K] @ lora_b[slot]: low_rank [T, S*K] holds
        every slot's low-rank columns of each row (x @ A[s].T for every s); out and low_rank may be column
        slices of one matmul's output (row strides larger than their widths). In place or new, as `apply`."""
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
        num_slots, width, in_features = lora_a.shape
        low_rank = x.to(lora_a.dtype) @ lora_a.reshape(num_slots * width, in_features).t()
        return self.expand(out, low_rank, lora_b, rows)

    def expand(self, out: torch.Tensor, low_rank: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots) -> torch.Tensor:
        slots = rows.slots
        num_slots, width, _ = lora_b.shape
        slot_ids = torch.arange(num_slots, dtype=slots.dtype, device=slots.device)
        mask = (slots.unsqueeze(1) == slot_ids).to(lora_b.dtype).repeat_interleave(width, dim=1)  # [T, S*K]
        return out + ((low_rank.to(lora_b.dtype) * mask) @ lora_b.reshape(num_slots * width, -1)).to(out.dtype)


class GatherLoRA:
    """Each row's own slot gathered (A[slot_t], B[slot_t]) and two batched matmuls: work per row independent
    of the number of slots, but a copy of both matrices per row. The reference the kernels are tested
    against, and the CPU path's alternative that benchmarks/lora.py --compare-cpu-paths times."""

    name = "gather"
    grouped = False

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
    ) -> torch.Tensor:
        index = rows.slots.clamp(min=0)
        low_rank = torch.bmm(lora_a[index], x.to(lora_a.dtype).unsqueeze(2)).squeeze(2)  # [T, K]
        return self._add(out, low_rank, lora_b, rows)

    def expand(self, out: torch.Tensor, low_rank: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots) -> torch.Tensor:
        num_slots, width, _ = lora_b.shape
        index = rows.slots.clamp(min=0)
        own = low_rank.reshape(-1, num_slots, width)[torch.arange(len(index), device=index.device), index]  # [T, K]
        return self._add(out, own, lora_b, rows)

    @staticmethod
    def _add(out: torch.Tensor, low_rank: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots) -> torch.Tensor:
        """out + each row's own low-rank columns [T, K] @ B[slot]; zeros for the rows of slot -1."""
        slots = rows.slots
        live = (slots >= 0).to(lora_b.dtype).unsqueeze(1)
        delta = torch.bmm(low_rank.to(lora_b.dtype).unsqueeze(1), lora_b[slots.clamp(min=0)]).squeeze(1)  # [T, out]
        return out + (delta * live).to(out.dtype)


DENSE_LORA = DenseLoRA()
GATHER_LORA = GatherLoRA()
