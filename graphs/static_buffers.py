"""Static decode inputs owned by a graph runner and filled in place before each replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from graphs.model_runner import DecodeBatchState


@dataclass
class StaticDecodeBuffers:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_indices: torch.Tensor  # [max_bs] slot dtype of the platform
    page_table: torch.Tensor  # [max_bs, max_pages] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    page_size: int
    # [4, max_bs] int64 whose rows ARE input_ids, positions and slot_indices (int64 slots only), and
    # the decode rows of the persistent state: one host-to-device copy fills all four.
    staging: torch.Tensor | None = None
    # [max_bs] int32 on the host: a copy of seq_lens for kernels that take lengths as host arguments
    # (Ascend's paged attention, refreshed by graph.update), where the platform asks for it.
    seq_lens_host: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        max_bs: int,
        max_pages: int,
        page_size: int,
        device: torch.device | str,
        slot_dtype: torch.dtype,
        host_lengths: bool = False,
    ) -> StaticDecodeBuffers:
        page_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
        seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        seq_lens_host = torch.zeros(max_bs, dtype=torch.int32) if host_lengths else None
        if slot_dtype == torch.int64:
            staging = torch.zeros(4, max_bs, dtype=torch.int64, device=device)
            return cls(staging[0], staging[1], staging[2], page_table, seq_lens, page_size, staging, seq_lens_host)
        return cls(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_indices=torch.zeros(max_bs, dtype=slot_dtype, device=device),
            page_table=page_table,
            seq_lens=seq_lens,
            page_size=page_size,
            seq_lens_host=seq_lens_host,
        )

    def views(self, bs: int) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, slot_indices, page_table, seq_lens) of the first bs rows: a step
        callable's positional arguments for the graph of size bs."""
        return (
            self.input_ids[:bs],
            self.positions[:bs],
            self.slot_indices[:bs],
            self.page_table[:bs],
            self.seq_lens[:bs],
        )

    def fill_from_rows(self, host_inputs: torch.Tensor, state: DecodeBatchState, padded_bs: int) -> torch.Tensor:
        """Fill from the persistent decode state: host_inputs [4, n] int64 = (tokens, positions, slots,
        rows) on the host; the page table rows and pending input tokens come from `state` on the
        device. One copy and a few gathers. Returns the decode rows (a view of the staging buffer)."""
        assert self.staging is not None
        n = host_inputs.shape[1]
        rows_table = state.page_table
        if rows_table.shape[1] != self.page_table.shape[1]:
            raise ValueError(
                f"decode rows hold {rows_table.shape[1]} pages; the graphs were captured for {self.page_table.shape[1]}"
            )
        self.staging[:, :n].copy_(host_inputs, non_blocking=True)
        rows = self.staging[3, :n]
        self.input_ids[:n].copy_(state.input_tokens(self.input_ids[:n], rows))
        torch.index_select(rows_table, 0, rows, out=self.page_table[:n])
        self.seq_lens[:n].copy_(self.positions[:n] + 1)
        self._pad(n, padded_bs)
        return rows

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, padded_bs: int) -> None:
        """Copy a real batch of n rows in; rows n..padded_bs become dummy rows.

        Dummy rows write their k/v to slot 0 (page 0 is never handed out) and
        attend over one token of it, so they stay finite and touch no request.
        """
        n = input_ids.shape[0]
        width = meta.page_table.shape[1]
        if width > self.page_table.shape[1]:
            raise ValueError(f"page table of {width} pages exceeds the captured {self.page_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_indices[:n].copy_(meta.slot_indices, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.page_table[:n, :width].copy_(meta.page_table, non_blocking=True)
        if width < self.page_table.shape[1]:
            self.page_table[:n, width:].zero_()
        self._pad(n, padded_bs)

    def _pad(self, n: int, padded_bs: int) -> None:
        if padded_bs > n:
            if self.staging is not None:
                self.staging[:3, n:padded_bs].zero_()
            else:
                self.input_ids[n:padded_bs].zero_()
                self.positions[n:padded_bs].zero_()
                self.slot_indices[n:padded_bs].zero_()
            self.seq_lens[n:padded_bs].fill_(1)
            self.page_table[n:padded_bs].zero_()

    def metadata(self, bs: int) -> AttentionMetadata:
        """Views of the first bs rows, as the captured graph of size bs sees them."""
        return AttentionMetadata(
            is_decode=True,
            slot_indices=self.slot_indices[:bs],
            page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs],
            page_size=self.page_size,
        )
