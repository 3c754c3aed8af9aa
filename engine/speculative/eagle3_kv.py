"""The EAGLE-3 head's KV cache: one store for every request, in the target pool's slot space.

`HeadKVStore` holds the head layer's keys and values [slots, kv_heads, head_dim] at the slot ids of the
target's KV pool: a request's head K/V for position p lie at the slot where the target keeps its K/V for p,
so the store is bounded by the pool (one layer of it) and follows the pool's paging with no allocator of its
own. Pages are freed, trimmed and handed to other requests by the target's KV manager alone; the head never
hears of it. What makes that safe is a stamp per slot, (writer, position) of the last write: a request reads a
slot only if the stamp is its own for that position, so a slot's K/V are rewritten by a new owner before that
owner ever reads them, and K/V a freed request left behind are never read by anyone.

`SlotTable` is each live request's row of slot ids by position (-1: never written), learned from the steps'
messages (the proposer does not see page tables): what a batched gather reads, [batch, bucketed length].

`grouped_attention` is one SDPA over a padded batch [batch, queries, ...] with a boolean mask, grouped-query
heads folded into the query axis so K/V are never repeated per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INITIAL_SLOTS = 4096  # without the pool's size the store grows by doubling from here
INITIAL_ROWS = 8  # requests; the table grows by doubling
MIN_BUCKET = 64  # context lengths are padded to a power of two from here (few shapes for a later capture)
POSITION_BITS = 32  # a stamp is writer << 32 | position


def bucket(length: int) -> int:
    """The padded length of a context of `length` positions: a power of two, at least MIN_BUCKET."""
    size = MIN_BUCKET
    while size < length:
        size *= 2
    return size


def stamps_of(writers: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The stamp of a write by `writers` at `positions` (broadcast)."""
    return (writers << POSITION_BITS) | positions


class HeadKVStore:
    """Keys, values and stamps by slot; the last slot is a trash slot for writes that lose a collision."""

    def __init__(
        self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, num_slots: int = 0
    ) -> None:
        """num_slots: the target pool's slots (allocated once); 0: unknown, grown to the largest slot seen."""
        self.fixed = num_slots > 0
        size = (num_slots if self.fixed else INITIAL_SLOTS) + 1
        self.keys = torch.zeros(size, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.stamps = torch.full((size,), -1, dtype=torch.int64, device=device)

    @property
    def trash(self) -> int:
        return self.keys.shape[0] - 1

    def ensure(self, max_slot: int) -> None:
        """Room for slot ids up to max_slot (host int); a fixed store is the pool's size already."""
        if max_slot < self.trash:
            return
        if self.fixed:
            raise ValueError(f"slot {max_slot} is past the head's store of {self.trash} slots (the target pool's)")
        size = self.trash
        while size <= max_slot:
            size *= 2
        grow = size + 1 - self.keys.shape[0]
        # The old trash slot becomes an ordinary one: its stamp is reset so nobody reads what lost there.
        self.stamps[self.trash] = -1
        self.keys = torch.cat([self.keys, self.keys.new_zeros(grow, *self.keys.shape[1:])])
        self.values = torch.cat([self.values, self.values.new_zeros(grow, *self.values.shape[1:])])
        self.stamps = torch.cat([self.stamps, self.stamps.new_full((grow,), -1)])

    def write(self, slots: torch.Tensor, stamps: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store [tokens] writes. Two writes to one slot in a call (a stale slot of a request whose page the
        prefix cache swapped for a duplicate, now another request's) keep the later one whole: an index_put
        with repeated indices picks a winner per tensor, which could pair one request's stamp with another's K/V."""
        slots = self._last_writes(slots)
        self.keys[slots] = keys
        self.values[slots] = values
        self.stamps[slots] = stamps

    def _last_writes(self, slots: torch.Tensor) -> torch.Tensor:
        """slots with every write but the last to each slot sent to the trash slot (no host sync)."""
        if slots.numel() < 2:
            return slots
        ordered, order = torch.sort(slots, stable=True)
        last = torch.ones_like(ordered, dtype=torch.bool)
        last[:-1] = ordered[1:] != ordered[:-1]
        keep = torch.empty_like(last).scatter_(0, order, last)
        return torch.where(keep, slots, torch.full_like(slots, self.trash))

    def gather(self, slots: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values [*slots.shape, kv_heads, head_dim], valid [*slots.shape]) for slot ids (-1: none);
        valid where the slot's stamp is the expected one (this request wrote it, for this position)."""
        index = slots.clamp(min=0)
        valid = (slots >= 0) & (self.stamps[index] == expected)
        return self.keys[index], self.values[index], valid


class SlotTable:
    """Rows of slot ids by position [rows, width] (-1: none), one per live request."""

    def __init__(self, device: torch.device) -> None:
        self.slots = torch.full((INITIAL_ROWS, MIN_BUCKET), -1, dtype=torch.int64, device=device)
        self.free = list(range(INITIAL_ROWS - 1, -1, -1))

    def reserve(self, rows: int, width: int) -> None:
        """Room for this many live requests and positions up front: a table that grows is a new tensor, and
        the draft loop's captured graphs read the old one (they are captured again)."""
        grow_rows = rows - self.slots.shape[0]
        if grow_rows > 0:
            self.free = list(range(rows - 1, self.slots.shape[0] - 1, -1)) + self.free
            self.slots = torch.cat([self.slots, self.slots.new_full((grow_rows, self.slots.shape[1]), -1)])
        self.ensure_width(width)

    def assign(self) -> int:
        if not self.free:
            rows, width = self.slots.shape
            self.slots = torch.cat([self.slots, self.slots.new_full((rows, width), -1)])
            self.free = list(range(2 * rows - 1, rows - 1, -1))
        return self.free.pop()

    def release(self, row: int) -> None:
        self.slots[row] = -1  # a later owner of the row starts with nothing
        self.free.append(row)

    def ensure_width(self, width: int) -> None:
        if width <= self.slots.shape[1]:
            return
        grown = bucket(width)
        self.slots = torch.cat(
            [self.slots, self.slots.new_full((self.slots.shape[0], grown - self.slots.shape[1]), -1)], 1
        )

    def forget_from(self, row: int, position: int) -> None:
        """The row's positions from `position` on are no longer the request's (recomputed by the target)."""
        self.slots[row, position:] = -1

    def set(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.slots[rows, positions] = slots


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [batch, queries, heads, head_dim] over keys/values [batch, length, kv_heads, head_dim] where mask
    [batch, queries, length] allows; -> [batch, queries, heads, head_dim]. Each kv head's query heads are
    folded into the query axis, [batch, kv_heads, groups x queries, head_dim], so one SDPA call serves the
    whole batch and no kernel needs grouped-query support. A row with no allowed key (a padding row, or a
    position whose slot lost a write collision) attends to every key: a finite output, discarded or only a
    worse draft, where SDPA would give NaN."""
    batch, queries, heads, head_dim = q.shape
    length, kv_heads = keys.shape[1], keys.shape[2]
    mask = mask | ~mask.any(-1, keepdim=True)
    groups = heads // kv_heads
    folded = q.view(batch, queries, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(batch, kv_heads, groups * queries, head_dim)
    folded_mask = mask.unsqueeze(1).expand(batch, groups, queries, length).reshape(batch, 1, groups * queries, length)
    out = F.scaled_dot_product_attention(
        folded, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=folded_mask
    )  # [batch, kv_heads, groups x queries, head_dim]
    out = out.view(batch, kv_heads, groups, queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, queries, heads, head_dim)
