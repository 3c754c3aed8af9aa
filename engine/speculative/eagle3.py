"""Drafts from an EAGLE-3 head (vLLM's "eagle3" method, SGLang's EAGLE3 algorithm), chains of topk 1.

After every target step the engine hands the proposer the step's tokens' inner-layer states
(`observe`: the tap's rows, engine/speculative/aux_hidden.py), kept per request as pending features with the
KV slots the target wrote those positions to. At the next draft the head first catches up: for each position
p the target computed whose next token is now known (the prompt's, the sampled one, the kept drafts), it runs
on (embedding of token p + 1, fc(features at p)) and stores its K/V at p's slot. Rows of rejected drafts are
never run: their next token is not the request's. The output at the request's last computed position
predicts the token after the one just sampled: draft 1. Each further draft feeds the head its own last output
(before its final norm) and the draft just made, one position on. Drafts are greedy (the argmax over the
draft vocabulary, mapped through d2t): a single token, as an n-gram's, so the verify step's acceptance rule is
exact for them.

The head's K/V live in one store for all requests, at the target pool's slot ids (engine/speculative/
eagle3_kv.py): a position's head K/V sit at the slot of its target K/V, stamped with (request, position), and
a request reads only its own stamps. Only positions whose next token is known are ever stored, so a rejection
leaves nothing to roll back; a chain's K/V stay in a scratch buffer of the draft loop. Freed pages need
nothing either: their stamps are no live request's. Positions the target never computed for the request (a
prefix-cache hit) have no stamp of its own: the head attends around them, fewer drafts accepted, never a
wrong token.

Attention is batched: the catch-up is one SDPA over [requests, new positions] (causal and stamp mask; very
unequal sizes split in a few groups), and each draft step one SDPA over [requests, 1] with the contexts
gathered once per propose into a [requests, bucketed length + drafts] buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.platform import DeviceGraphs
from engine.request import Request
from engine.scheduler import ScheduledStep
from engine.speculative.aux_hidden import AuxHiddenTap
from engine.speculative.eagle3_head import Eagle3Head
from engine.speculative.eagle3_kv import HeadKVStore, SlotTable, bucket, grouped_attention, stamps_of
from engine.speculative.eagle3_loop import CatchUpRow, DraftLoop
from engine.step_message import StepMessage

# A catch-up group's padded batch x queries x keys stays under this (several long prompts caught up together
# would otherwise pad every request to the longest); a single request always forms a group.
CATCH_UP_BUDGET = 1 << 22
# The slot table is allocated for contexts up to this many positions (8 bytes per position and request).
MAX_RESERVED_CONTEXT = 1 << 14


@dataclass
class _Pending:
    """Rows of a target step not yet run through the head: from position `first`, the tap's rows
    [n, 3 x hidden] (rows `start`.. of the step's copy of the tap, `source`) and the KV slots the target
    wrote them to."""

    first: int
    source: torch.Tensor
    start: int
    slots: list[int]

    @property
    def rows(self) -> torch.Tensor:
        return self.source[self.start : self.start + len(self.slots)]

    def before(self, position: int) -> _Pending:
        keep = max(position - self.first, 0)
        return _Pending(self.first, self.source, self.start, self.slots[:keep])


@dataclass
class _RequestState:
    writer: int  # the stamp's request part: unique to this state (a redo after retraction gets a new one)
    row: int  # the request's row of the slot table
    length: int = 0  # head positions stored: 0..length - 1 (those the target computed for it)
    pending: list[_Pending] = field(default_factory=list)


@dataclass
class _Output:
    """The head's output at a request's last computed position: what its chain starts from."""

    position: int
    normed: torch.Tensor  # for the LM head
    hidden: torch.Tensor  # before the final norm: the next step's feature


@dataclass
class _CatchUpRow:
    """One request's positions in a catch-up: its indices into the flat token list, in position order."""

    state: _RequestState
    tokens: list[int]  # indices into the flat catch-up
    positions: list[int]


class Eagle3Proposer:
    def __init__(
        self,
        head: Eagle3Head,
        embed: Callable[[torch.Tensor], torch.Tensor],
        tap: AuxHiddenTap,
        num_tokens: int,
        device: torch.device,
        num_slots: int = 0,
        max_batch: int = 256,
        graphs: DeviceGraphs | None = None,
        max_context: int = 0,
    ) -> None:
        """embed: the target's token embedding (used unless the head has its own); tap: the target's
        inner-layer states of each step (the engine sets it on the model); num_slots: the target KV pool's
        slots (pages x page size), so the head's store is allocated once; 0: grown to the slots seen.
        max_batch: the most requests in a step; graphs: the platform's device graphs, which capture the
        draft loop (None: it runs eagerly); max_context: the target's context length (0: unknown), for
        which the slot table is sized when the store is allocated."""
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else embed
        self.tap = tap
        self.num_tokens = num_tokens
        self.device = device
        config = head.config
        dtype = head.fc.weight.dtype
        self.store = HeadKVStore(config.num_key_value_heads, config.head_dim, dtype, device, num_slots)
        self._store_shape = (config.num_key_value_heads, config.head_dim, dtype)
        self.table = SlotTable(device)
        self.states: dict[str, _RequestState] = {}
        self._writers = itertools.count(1)
        self.loop = DraftLoop(head, self.embed, num_tokens, max_batch, device, graphs)
        self.max_batch, self.max_context = max_batch, max_context

    # ---- the engine's calls ------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """What the head's store takes per slot of the target's pool (keys, values and a stamp): the engine
        counts it when it sizes the pool, so that the store allocated after it fits."""
        kv_heads, head_dim, dtype = self._store_shape
        return 2 * kv_heads * head_dim * dtype.itemsize + 8

    def allocate_store(self, num_slots: int) -> None:
        """The store at the target pool's size (pages x page size), once the engine has allocated the pool and
        before any request: no growth, and so no allocation, while serving."""
        kv_heads, head_dim, dtype = self._store_shape
        self.store = HeadKVStore(kv_heads, head_dim, dtype, self.device, num_slots)
        # The slot table too, for every request a step holds (and the draft loop's padding row), over the
        # context up to MAX_RESERVED_CONTEXT positions (a longer one grows it when it comes).
        self.table.reserve(self.max_batch + 2, bucket(min(self.max_context, MAX_RESERVED_CONTEXT)))

    def observe(self, step: ScheduledStep, message: StepMessage) -> None:
        """A launched target step: each request's rows of the tap, with the position of its first one and
        the slots of all."""
        positions: list[int] = []
        slots: list[int] = []
        counts: list[int] = []
        if message.decode is not None:
            inputs = message.decode.inputs
            positions += inputs[1].tolist()
            slots += inputs[2].tolist()
            drafts = step.drafts or [[] for _ in range(step.num_decodes)]
            counts += [1 + len(d) for d in drafts]
        if message.extend is not None:
            positions += message.extend.positions
            slots += message.extend.slots
            counts += step.extend_lens
        rows = self.tap.rows(len(positions)).clone()  # the step's rows, one copy (the tap is rewritten next step)
        offset = 0
        for request, count in zip(step.requests, counts):
            state = self.states.get(request.request_id)
            if state is None:
                state = self.states[request.request_id] = _RequestState(next(self._writers), self.table.assign())
            first = positions[offset]
            # A step recomputes from `first` on: rows of earlier steps there were drafts it rejected.
            state.pending = [p.before(first) for p in state.pending if p.first < first]
            end = offset + count
            state.pending.append(_Pending(first, rows, offset, slots[offset:end]))
            offset = end

    def forget(self, request: Request) -> None:
        """The request holds no KV any more (finished, aborted, retracted: a redo is observed anew). Its
        stamps in the store die with its writer id; its pages' next owners rewrite them before reading."""
        state = self.states.pop(request.request_id, None)
        if state is not None:
            self.table.release(state.row)

    @torch.no_grad()
    def propose(self, requests: list[Request], limits: list[int], on_device: bool = False) -> list[list[int]]:
        """At most min(num_tokens, limit) greedy drafts per request; every request's pending features are
        run through the head first (a request with limit 0 too: its cache must keep up). on_device: the
        drafts stay on the device, as pending draft tokens (DraftLoop.chains): the host does not wait for them."""
        drafts: list[list[int]] = [[] for _ in requests]
        kept = self._decode_catch_up(requests)
        if kept is not None:
            # Every request's last verify step, in the loop's fixed shapes; the chain runs for all of them.
            length = bucket(max(r.first + len(r.next_tokens) for r in kept))
            self.table.ensure_width(length)
            self.loop.bind(self.store, self.table)
            self.loop.catch_up(kept, length)
            if not any(limits):
                return drafts
            tokens = self.loop.chains(len(requests), length, on_device)
            return [chain[: min(self.num_tokens, limit)] for chain, limit in zip(tokens, limits)]
        last = self._catch_up(requests)
        chains = [
            (index, min(self.num_tokens, limit)) for index, limit in enumerate(limits) if limit > 0 and index in last
        ]
        if not chains:
            return drafts
        states = [self.states[requests[index].request_id] for index, _ in chains]
        outputs = [last[index] for index, _ in chains]
        length = bucket(max(o.position for o in outputs) + 1)
        self.table.ensure_width(length)
        self.loop.bind(self.store, self.table)
        self.loop.set_chain_inputs(
            [s.row for s in states],
            [s.writer for s in states],
            [o.position + 1 for o in outputs],
            torch.stack([o.normed for o in outputs]),
            torch.stack([o.hidden for o in outputs]),
        )
        tokens = self.loop.chains(len(chains), length, on_device)
        for (index, n), chain in zip(chains, tokens):
            drafts[index] = chain[:n]
        return drafts

    def _decode_catch_up(self, requests: list[Request]) -> list[CatchUpRow] | None:
        """Each request's kept positions of its last verify step, where every request has just those: one
        step's rows, 1 to k + 1 positions right after what the head stored, the last one the position before
        the token just sampled. None otherwise (a prompt, steps without drafts piled up, a recomputation):
        the general catch-up runs."""
        rows: list[CatchUpRow] = []
        for request in requests:
            state = self.states.get(request.request_id)
            if state is None or len(state.pending) != 1:
                return None
            pending = state.pending[0]
            num_tokens = request.num_tokens
            size = num_tokens - 1 - pending.first  # positions whose next token is known
            if pending.first != state.length or not 0 < size <= min(len(pending.slots), self.loop.queries):
                return None
            output = request.output_token_ids
            first_output = num_tokens - len(output)
            if pending.first + 1 < first_output:
                return None
            next_tokens = output[pending.first + 1 - first_output : num_tokens - first_output]
            rows.append(
                CatchUpRow(
                    state.row,
                    state.writer,
                    pending.first,
                    next_tokens,
                    pending.slots[:size],
                    pending.source,
                    pending.start,
                )
            )
        for request, row in zip(requests, rows):
            state = self.states[request.request_id]
            state.pending = []
            state.length = row.first + len(row.next_tokens)
        return rows

    def valid_positions(self, request: Request) -> torch.Tensor:
        """[length] bool: the head positions of the request it would attend to (its own stored K/V)."""
        state = self.states[request.request_id]
        self.table.ensure_width(state.length)
        slots = self.table.slots[state.row, : state.length]
        expected = stamps_of(
            torch.tensor(state.writer, device=self.device), torch.arange(state.length, device=self.device)
        )
        return self.store.gather(slots, expected)[2]

    # ---- the catch-up ------------------------------------------------------------------------------
    def _catch_up(self, requests: list[Request]) -> dict[int, _Output]:
        """Run each request's pending positions whose next token is known through the head, in one batch;
        {request index: (its last position, normed output, output before the norm)} for the requests whose
        last computed position (the one before the token just sampled) was among them."""
        token_ids: list[int] = []
        aux: list[torch.Tensor] = []
        positions: list[int] = []
        slots: list[int] = []
        batch: list[_CatchUpRow] = []
        owners: list[tuple[int, int]] = []  # (request index, flat row of its last position) where it can draft
        for index, request in enumerate(requests):
            state = self.states.get(request.request_id)
            if state is None:
                continue
            row = self._gather_pending(state, request.all_token_ids, token_ids, aux, positions, slots)
            state.pending = []
            if row is None:
                continue
            batch.append(row)
            if row.positions[-1] == len(request.all_token_ids) - 2:
                owners.append((index, row.tokens[-1]))
        if not batch:
            return {}
        self.store.ensure(max(slots))
        self.table.ensure_width(max(positions) + 1)
        embeds = self.embed(torch.tensor(token_ids, device=self.device))
        feature = self.head.fuse(torch.cat(aux).to(embeds.dtype))
        position_tensor = torch.tensor(positions, device=self.device)
        slot_tensor = torch.tensor(slots, device=self.device)
        attend = self._catch_up_attention(batch, position_tensor, slot_tensor)
        normed, hidden = self.head.layer(embeds, feature, position_tensor, attend)
        return {index: _Output(positions[row], normed[row], hidden[row]) for index, row in owners}

    def _gather_pending(
        self,
        state: _RequestState,
        tokens: list[int],
        token_ids: list[int],
        aux: list[torch.Tensor],
        positions: list[int],
        slots: list[int],
    ) -> _CatchUpRow | None:
        """Append the request's runnable pending positions to the flat lists; its row of the batch (None:
        nothing to run). Positions from the first on are the request's anew (a recomputation drops what
        the head stored past it)."""
        row: _CatchUpRow | None = None
        for pending in state.pending:
            size = min(pending.rows.shape[0], len(tokens) - 1 - pending.first)  # positions whose next token is known
            if size <= 0:
                continue
            if row is None:
                row = _CatchUpRow(state, [], [])
                if pending.first < state.length:
                    self.table.forget_from(state.row, pending.first)
            start = len(positions)
            row.tokens += range(start, start + size)
            row.positions += range(pending.first, pending.first + size)
            token_ids += tokens[pending.first + 1 : pending.first + 1 + size]
            aux.append(pending.rows[:size])
            positions += range(pending.first, pending.first + size)
            slots += pending.slots[:size]
        if row is not None:
            state.length = row.positions[-1] + 1
        return row

    def _catch_up_attention(
        self, batch: list[_CatchUpRow], positions: torch.Tensor, slots: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The catch-up's attention: store every new K/V first (a request's later positions see its earlier
        ones), then each group of requests in one SDPA over [group, new positions] x [its bucketed context]."""
        writers = torch.tensor([r.state.writer for r in batch for _ in r.tokens], device=self.device)
        rows = torch.tensor([r.state.row for r in batch for _ in r.tokens], device=self.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.store.write(slots, stamps_of(writers, positions), k, v)
            self.table.set(rows, positions, slots)
            out = torch.empty_like(q)
            for group in _groups(batch):
                self._attend_group(group, q, out)
            return out

        return attend

    def _attend_group(self, group: list[_CatchUpRow], q: torch.Tensor, out: torch.Tensor) -> None:
        """Queries padded to [group, most new positions], keys to [group, bucket(last position + 1)]: each
        query sees its request's stored positions up to its own."""
        queries = max(len(r.tokens) for r in group)
        length = bucket(max(r.positions[-1] for r in group) + 1)
        self.table.ensure_width(length)
        device = self.device
        flat = torch.tensor([t for r in group for t in r.tokens], device=device)
        batch_index = torch.tensor([b for b, r in enumerate(group) for _ in r.tokens], device=device)
        query_index = torch.tensor([j for r in group for j in range(len(r.tokens))], device=device)
        query_positions = torch.full((len(group), queries), -1, dtype=torch.int64, device=device)
        query_positions[batch_index, query_index] = torch.tensor([p for r in group for p in r.positions], device=device)
        padded = q.new_zeros(len(group), queries, *q.shape[1:])
        padded[batch_index, query_index] = q[flat]
        keys, values, valid = self._context([r.state for r in group], length)
        columns = torch.arange(length, device=device)
        mask = valid.unsqueeze(1) & (columns <= query_positions.unsqueeze(2))  # padding rows: none (discarded)
        out[flat] = grouped_attention(padded, keys, values, mask)[batch_index, query_index]

    def _context(self, states: list[_RequestState], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The requests' stored K/V by position [batch, length, kv_heads, head_dim] and where they are
        theirs [batch, length]."""
        rows = torch.tensor([s.row for s in states], device=self.device)
        writers = torch.tensor([s.writer for s in states], device=self.device)
        columns = torch.arange(length, device=self.device)
        return self.store.gather(self.table.slots[rows, :length], stamps_of(writers.unsqueeze(1), columns))


def _groups(batch: list[_CatchUpRow]) -> list[list[_CatchUpRow]]:
    """The catch-up's requests in groups whose padded size stays within CATCH_UP_BUDGET, by size: at decode
    time every request has a few new positions and they form one group; a prompt's catch-up goes apart."""
    groups: list[list[_CatchUpRow]] = []
    current: list[_CatchUpRow] = []
    queries = keys = 0
    for row in sorted(batch, key=lambda r: len(r.tokens)):
        grown_queries = max(queries, len(row.tokens))
        grown_keys = max(keys, bucket(row.positions[-1] + 1))
        if current and (len(current) + 1) * grown_queries * grown_keys > CATCH_UP_BUDGET:
            groups.append(current)
            current, grown_queries, grown_keys = [], len(row.tokens), bucket(row.positions[-1] + 1)
        current.append(row)
        queries, keys = grown_queries, grown_keys
    groups.append(current)
    return groups
