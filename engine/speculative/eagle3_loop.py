"""The EAGLE-3 head's work of a decode-time propose in fixed shapes, captured as device graphs.

Between two verify steps the head does the same few things for every request: it catches up on the
positions the last verify step kept (one to k + 1 per request) and then drafts a chain of k tokens. Run op
by op from the host that is some 150 small launches per step, and on an H100 the host's launches, not the
device, set the pace: the chain and its catch-up cost more than the 8B target's verify step. Here both run
over persistent buffers in shapes fixed by (padded batch, context bucket): the catch-up as [batch, k + 1]
queries (a request with fewer kept positions pads its row), the chain as in eagle3.py. Where the platform
has device graphs (`Platform.device_graphs`) each shape is captured the first time it runs and replayed
after; elsewhere the same functions run eagerly.

The host fills one pinned buffer of int64 fields and copies it in one transfer; the tap rows the catch-up
reads are gathered into a persistent buffer in one launch when they come from one step (the usual case).
Padding rows write only the store's trash slot and the slot table's padding row, and their drafts are
dropped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.platform import DeviceGraphs
from engine.speculative.eagle3_head import Eagle3Head
from engine.speculative.eagle3_kv import HeadKVStore, SlotTable, grouped_attention, stamps_of
from engine.step_message import pending_draft

logger = logging.getLogger(__name__)

# Per-query fields of the staging buffer (batch x queries entries), then per-row fields (batch entries).
TOKENS, POSITIONS, SLOTS, TABLE_ROWS, TABLE_COLUMNS, TABLE_VALUES, AUX_ROWS = range(7)
NUM_QUERY_FIELDS = 7
LAST, ROWS, WRITERS, ENDS = range(7, 11)
NUM_FIELDS = 11
# A shape is captured only while its gathered context (padded batch x context bucket) stays within this:
# larger ones run eagerly rather than hold their temporaries in the graph pool for good.
MAX_GRAPHED_CONTEXT = 1 << 18


@dataclass
class CatchUpRow:
    """One request's kept positions of the last verify step: `size` positions from `first`, their next tokens,
    KV slots, and where their tap rows are (`source` rows from `source_start`)."""

    row: int  # the request's row of the slot table
    writer: int
    first: int
    next_tokens: list[int]
    slots: list[int]
    source: torch.Tensor
    source_start: int


def padded_batch(batch: int, max_batch: int) -> int:
    """A power of two at least `batch` (few shapes to capture), at most max_batch."""
    size = 1
    while size < batch:
        size *= 2
    return min(size, max_batch)


class DraftLoop:
    def __init__(
        self,
        head: Eagle3Head,
        embed: Callable[[torch.Tensor], torch.Tensor],
        num_tokens: int,
        max_batch: int,
        device: torch.device,
        graphs: DeviceGraphs | None,
    ) -> None:
        """num_tokens: drafts per chain (k); max_batch: the most requests a step drafts for."""
        self.head = head
        self.embed = embed
        self.num_tokens = num_tokens
        self.queries = num_tokens + 1
        self.max_batch = padded_batch(max_batch, 1 << 30)
        self.device = device
        self.graphs = graphs
        width = self.max_batch * self.queries
        pinned = device.type == "cuda"
        self.host = torch.zeros(NUM_FIELDS, width, dtype=torch.int64, pin_memory=pinned)
        self.fields = torch.zeros(NUM_FIELDS, width, dtype=torch.int64, device=device)
        config = head.config
        dtype = head.fc.weight.dtype
        self.aux = torch.zeros(width, 3 * config.target_hidden_size, dtype=dtype, device=device)
        self.normed = torch.zeros(self.max_batch, config.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros_like(self.normed)
        self.drafts = torch.zeros(self.max_batch, num_tokens, dtype=torch.int64, device=device)
        # Drafts left on the device for the verify step come back here, copied while the verify step runs.
        self.host_drafts = torch.zeros(self.max_batch * num_tokens, dtype=torch.int64, pin_memory=pinned)
        self._drafts_copied: torch.cuda.Event | None = None
        self.store: HeadKVStore | None = None
        self.table: SlotTable | None = None
        self.padding_row = -1
        self.replays: dict[tuple[str, int, int], Callable[[], None]] = {}
        self._captured_over: tuple[torch.Tensor, ...] = ()
        self._uploaded: torch.cuda.Event | None = None

    def bind(self, store: HeadKVStore, table: SlotTable) -> None:
        """The store and slot table the functions read; graphs captured over other tensors are dropped (a
        store or table that grew is a new tensor)."""
        if table is not self.table:
            self.padding_row = table.assign()  # never released: all -1, what padding rows read
        self.store, self.table = store, table
        tensors = (store.keys, store.values, store.stamps, table.slots)
        if len(tensors) != len(self._captured_over) or any(a is not b for a, b in zip(tensors, self._captured_over)):
            self.replays.clear()
            self._captured_over = tensors

    # ---- the host's side ------------------------------------------------------------------------------
    def catch_up(self, rows: list[CatchUpRow], length: int) -> None:
        """Run the rows' kept positions through the head (storing their K/V) and leave each row's last output
        in the chain's inputs. length: the context bucket, past every row's last position."""
        assert self.store is not None
        batch = padded_batch(len(rows), self.max_batch)
        queries = self.queries
        n = batch * queries
        per_query = [[0] * n for _ in range(NUM_QUERY_FIELDS)]
        per_query[SLOTS] = [self.store.trash] * n  # padding queries write the trash slot and the padding row
        per_query[TABLE_ROWS] = [self.padding_row] * n
        per_query[TABLE_VALUES] = [-1] * n
        per_row = [[0] * batch, [self.padding_row] * batch, [0] * batch, [1] * batch]  # LAST, ROWS, WRITERS, ENDS
        for b, r in enumerate(rows):
            size = len(r.next_tokens)
            start, end = b * queries, b * queries + size
            positions = range(r.first, r.first + size)
            per_query[TOKENS][start:end] = r.next_tokens
            per_query[POSITIONS][start:end] = positions
            per_query[SLOTS][start:end] = r.slots
            per_query[TABLE_ROWS][start:end] = [r.row] * size
            per_query[TABLE_COLUMNS][start:end] = positions
            per_query[TABLE_VALUES][start:end] = r.slots
            per_query[AUX_ROWS][start:end] = range(r.source_start, r.source_start + size)
            per_row[0][b], per_row[1][b], per_row[2][b], per_row[3][b] = end - 1, r.row, r.writer, r.first + size
        self._upload(per_query, per_row)
        if len({id(r.source) for r in rows}) == 1:  # the rows of one step: one gather
            torch.index_select(rows[0].source, 0, self.fields[AUX_ROWS, :n], out=self.aux[:n])
        else:
            for b, r in enumerate(rows):
                size = len(r.next_tokens)
                self.aux[b * queries : b * queries + size] = r.source[r.source_start : r.source_start + size]
        self._run("catch-up", batch, length, self._catch_up)

    def _upload(self, per_query: list[list[int]], per_row: list[list[int]]) -> None:
        """The host's fields in one transfer (the pinned buffer is rewritten only once the last one is done)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        if per_query:
            self.host[:NUM_QUERY_FIELDS, : len(per_query[0])] = torch.tensor(per_query)
        self.host[NUM_QUERY_FIELDS:, : len(per_row[0])] = torch.tensor(per_row)
        self.fields.copy_(self.host, non_blocking=True)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def set_chain_inputs(
        self, rows: list[int], writers: list[int], ends: list[int], normed: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """The chains' inputs where the catch-up ran another way (a prompt's): each chain's table row, stamp
        writer, first position, and the head's outputs at the position before."""
        pad = padded_batch(len(rows), self.max_batch) - len(rows)
        last = [0] * (len(rows) + pad)
        self._upload([], [last, rows + [self.padding_row] * pad, writers + [0] * pad, ends + [1] * pad])
        self.normed[: len(rows)] = normed
        self.hidden[: len(rows)] = hidden

    def chains(self, num_chains: int, length: int, on_device: bool = False) -> list[list[int]]:
        """k greedy drafts for each of the first num_chains rows of the chain's inputs. on_device: without
        waiting for them: each draft is a pending draft token naming its entry of `drafts` (engine/
        step_message.py), which the verify step reads on the device; `read_drafts` gives the values later."""
        batch = padded_batch(num_chains, self.max_batch)
        self._run("chain", batch, length, self._chain)
        if not on_device:
            drafts: list[list[int]] = self.drafts[:num_chains].tolist()  # the one read-back of a propose
            return drafts
        k = self.num_tokens
        self.host_drafts[: num_chains * k].copy_(self.drafts[:num_chains].view(-1), non_blocking=True)
        if self.device.type == "cuda":
            self._drafts_copied = torch.cuda.Event()
            self._drafts_copied.record()
        return [[pending_draft(b * k + j) for j in range(k)] for b in range(num_chains)]

    def read_drafts(self) -> list[int]:
        """The last on-device chains' drafts, flat (entry b * k + j: chain b's draft j); valid until the next
        chains."""
        if self._drafts_copied is not None:
            self._drafts_copied.synchronize()
        values: list[int] = self.host_drafts.tolist()
        return values

    def _run(self, kind: str, batch: int, length: int, fn: Callable[[int, int], None]) -> None:
        key = (kind, batch, length)
        replay = self.replays.get(key)
        if replay is not None:
            replay()
            return
        if self.graphs is None or batch * (length + self.queries) > MAX_GRAPHED_CONTEXT:
            with self._attention_kernels():
                fn(batch, length)
            return
        started = time.perf_counter()

        def run() -> None:
            with self._attention_kernels():
                fn(batch, length)

        replay = self.replays[key] = self.graphs.capture(run)
        replay()
        logger.info(
            "EAGLE-3 %s captured for batch %d, context %d in %.3f s (%d draft-loop graphs)",
            kind,
            batch,
            length,
            time.perf_counter() - started,
            len(self.replays),
        )

    def _attention_kernels(self) -> contextlib.AbstractContextManager[None]:
        """On CUDA, SDPA without cuDNN's: its masked attention builds a plan on the host per call (~0.9 ms of
        an H100 machine's host each, four per propose at k = 4)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    # ---- what the graphs capture ----------------------------------------------------------------------
    def _catch_up(self, batch: int, length: int) -> None:
        store, table = self.store, self.table
        assert store is not None and table is not None
        n, queries, fields = batch * self.queries, self.queries, self.fields
        positions = fields[POSITIONS, :n]
        writers = fields[WRITERS, :batch]
        rows = fields[ROWS, :batch]
        embeds = self.embed(fields[TOKENS, :n])
        feature = self.head.fuse(self.aux[:n].to(embeds.dtype))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Every new K/V is stored first: a request's later positions see its earlier ones.
            store.write(fields[SLOTS, :n], stamps_of(writers.repeat_interleave(queries), positions), k, v)
            table.slots[fields[TABLE_ROWS, :n], fields[TABLE_COLUMNS, :n]] = fields[TABLE_VALUES, :n]
            columns = torch.arange(length, device=positions.device)
            keys, values, valid = store.gather(table.slots[rows, :length], stamps_of(writers.unsqueeze(1), columns))
            mask = valid.unsqueeze(1) & (columns <= positions.view(batch, queries, 1))
            out = grouped_attention(q.view(batch, queries, *q.shape[1:]), keys, values, mask)
            return out.reshape(q.shape)

        normed, hidden = self.head.layer(embeds, feature, positions, attend)
        last = fields[LAST, :batch]
        self.normed[:batch] = normed[last]
        self.hidden[:batch] = hidden[last]

    def _chain(self, batch: int, length: int) -> None:
        """As eagle3.py's chains: the contexts gathered once into [batch, length + drafts - 1]; draft step j
        writes its K/V at column length + j and attends over the context and the chain so far."""
        store, table = self.store, self.table
        assert store is not None and table is not None
        fields = self.fields
        rows, writers, ends = fields[ROWS, :batch], fields[WRITERS, :batch], fields[ENDS, :batch]
        columns = torch.arange(length, device=rows.device)
        context_keys, context_values, valid = store.gather(
            table.slots[rows, :length], stamps_of(writers.unsqueeze(1), columns)
        )
        valid = valid & (columns < ends.unsqueeze(1))
        steps = self.num_tokens - 1
        keys = torch.cat([context_keys, context_keys.new_zeros(batch, steps, *context_keys.shape[2:])], 1)
        values = torch.cat([context_values, context_values.new_zeros(batch, steps, *context_values.shape[2:])], 1)
        mask = torch.cat([valid, valid.new_zeros(batch, steps)], 1)
        feature = self.hidden[:batch]
        tokens = self.head.to_target_ids(self.head.draft_logits(self.normed[:batch]).argmax(-1))
        drafted = [tokens]
        for step in range(steps):
            column = length + step

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, column: int = column) -> torch.Tensor:
                keys[:, column] = k
                values[:, column] = v
                mask[:, column] = True
                return grouped_attention(q.unsqueeze(1), keys, values, mask.unsqueeze(1)).squeeze(1)

            normed, feature = self.head.layer(self.embed(tokens), feature, ends + step, attend)
            tokens = self.head.to_target_ids(self.head.draft_logits(normed).argmax(-1))
            drafted.append(tokens)
        self.drafts[:batch] = torch.stack(drafted, 1)
