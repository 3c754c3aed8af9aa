"""Drafts from an EAGLE-3 head (vLLM's "eagle3" method, SGLang's EAGLE3 algorithm), chains of topk 1.

After every target step the engine hands the proposer the step's tokens' inner-layer states
(`observe`: the tap's rows, engine/speculative/aux_hidden.py), kept per request as pending features. At the
next draft the head first catches up: for each position p the target computed whose next token is now known
(the prompt's, the sampled one, the kept drafts), it runs on (embedding of token p + 1, fc(features at p))
and stores its K/V at p. Rows of rejected drafts are never run: their next token is not the request's. The
output at the request's last computed position predicts the token after the one just sampled: draft 1. Each
further draft feeds the head its own last output (before its final norm) and the draft just made, one
position on. Drafts are greedy (the argmax over the draft vocabulary, mapped through d2t): a single token,
as an n-gram's, so the verify step's acceptance rule is exact for them.

The head's KV cache is small (one layer) and per request, indexed by position: a chain's K/V are written
past the committed length and dropped after it, and a later catch-up overwrites positions from where it
starts, so rejection and retraction roll it back with nothing to free. Positions the target never computed
(a prefix-cache hit) leave gaps the head attends around: fewer drafts accepted, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.request import Request
from engine.scheduler import ScheduledStep
from engine.speculative.aux_hidden import AuxHiddenTap
from engine.speculative.eagle3_head import Eagle3Head
from engine.step_message import StepMessage

INITIAL_POSITIONS = 64  # a request's head cache grows by doubling from here


class HeadCache:
    """One request's K/V of the head's layer by position; positions below `length` are its context (those in
    `filled`: a prefix-cache hit leaves gaps), anything written past it is a chain's and is dropped."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(INITIAL_POSITIONS, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.filled = torch.zeros(INITIAL_POSITIONS, dtype=torch.bool, device=device)
        self.length = 0

    def _ensure(self, end: int) -> None:
        capacity = self.keys.shape[0]
        if end <= capacity:
            return
        while capacity < end:
            capacity *= 2
        grow = capacity - self.keys.shape[0]
        self.keys = torch.cat([self.keys, self.keys.new_zeros(grow, *self.keys.shape[1:])])
        self.values = torch.cat([self.values, self.values.new_zeros(grow, *self.values.shape[1:])])
        self.filled = torch.cat([self.filled, self.filled.new_zeros(grow)])

    def attend(self, first: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, commit: bool) -> torch.Tensor:
        """Store k/v at positions first.. and attend q (the same positions) causally over the cache.
        commit: the positions become the context (a catch-up, which rolls back whatever lay past `first`);
        otherwise they are a chain's drafts, dropped by `drop_drafts`."""
        n = q.shape[0]
        end = first + n
        self._ensure(end)
        if commit:
            self.filled[first:] = False
        self.keys[first:end] = k
        self.values[first:end] = v
        self.filled[first:end] = True
        if commit:
            self.length = end
        query_positions = torch.arange(first, end, device=q.device).unsqueeze(1)
        key_positions = torch.arange(end, device=q.device).unsqueeze(0)
        mask = self.filled[:end].unsqueeze(0) & (key_positions <= query_positions)  # [n, end]
        groups = q.shape[1] // k.shape[1]
        keys = self.keys[:end].repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, end, head_dim]
        values = self.values[:end].repeat_interleave(groups, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)  # [n, heads, head_dim]

    def drop_drafts(self) -> None:
        self.filled[self.length :] = False


@dataclass
class _RequestState:
    cache: HeadCache
    # (first position, the tap's rows [n, 3 x hidden]) of target steps not yet run through the head.
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Segment:
    """Consecutive positions of one request in a batched head step."""

    cache: HeadCache
    first: int
    size: int


@dataclass
class _Output:
    """The head's output at a request's last computed position: what its chain starts from."""

    position: int
    normed: torch.Tensor  # for the LM head
    hidden: torch.Tensor  # before the final norm: the next step's feature


class Eagle3Proposer:
    def __init__(
        self,
        head: Eagle3Head,
        embed: Callable[[torch.Tensor], torch.Tensor],
        tap: AuxHiddenTap,
        num_tokens: int,
        device: torch.device,
    ) -> None:
        """embed: the target's token embedding (used unless the head has its own); tap: the target's
        inner-layer states of each step (the engine sets it on the model)."""
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else embed
        self.tap = tap
        self.num_tokens = num_tokens
        self.device = device
        self.states: dict[str, _RequestState] = {}

    def observe(self, step: ScheduledStep, message: StepMessage) -> None:
        """A launched target step: each request's rows of the tap, with the position of its first one."""
        positions: list[int] = []
        counts: list[int] = []
        if message.decode is not None:
            positions += message.decode.inputs[1].tolist()
            drafts = step.drafts or [[] for _ in range(step.num_decodes)]
            counts += [1 + len(d) for d in drafts]
        if message.extend is not None:
            positions += message.extend.positions
            counts += step.extend_lens
        rows = self.tap.rows(len(positions))
        offset = 0
        for request, count in zip(step.requests, counts):
            state = self.states.get(request.request_id)
            if state is None:
                state = self.states[request.request_id] = _RequestState(self._new_cache())
            first = positions[offset]
            # A step recomputes from `first` on: rows of earlier steps there were drafts it rejected.
            state.pending = [(f, r[: first - f]) for f, r in state.pending if f < first]
            state.pending.append((first, rows[offset : offset + count].clone()))
            offset += count

    def forget(self, request: Request) -> None:
        """The request holds no KV any more (finished, aborted, retracted: a redo is observed anew)."""
        self.states.pop(request.request_id, None)

    def _new_cache(self) -> HeadCache:
        config = self.head.config
        dtype = self.head.fc.weight.dtype
        return HeadCache(config.num_key_value_heads, config.head_dim, dtype, self.device)

    @torch.no_grad()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """At most min(num_tokens, limit) greedy drafts per request; every request's pending features are
        run through the head first (a request with limit 0 too: its cache must keep up)."""
        drafts: list[list[int]] = [[] for _ in requests]
        last = self._catch_up(requests)
        # The chains: (request index, its cache, its number of drafts, the position of its last output).
        chains = [
            (index, self.states[r.request_id].cache, min(self.num_tokens, limit), last[index].position)
            for index, (r, limit) in enumerate(zip(requests, limits))
            if limit > 0 and index in last
        ]
        if chains:
            normed = torch.stack([last[index].normed for index, *_ in chains])
            feature = torch.stack([last[index].hidden for index, *_ in chains])
        for step in range(max((n for _, _, n, _ in chains), default=0)):
            tokens = self.head.to_target_ids(self.head.draft_logits(normed).argmax(-1))
            for (index, *_), token in zip(chains, tokens.tolist()):
                drafts[index].append(token)
            going = [i for i, (_, _, n, _) in enumerate(chains) if n > step + 1]
            if not going:
                break
            keep = torch.tensor(going, device=self.device)
            chains = [chains[i] for i in going]
            position = [p + step + 1 for *_, p in chains]  # each draft one position past the last
            segments = [_Segment(cache, p, 1) for (_, cache, _, _), p in zip(chains, position)]
            normed, feature = self.head.layer(
                self.embed(tokens[keep]),
                feature[keep],
                torch.tensor(position, device=self.device),
                self._attend(segments, commit=False),
            )
        for r in requests:
            state = self.states.get(r.request_id)
            if state is not None:
                state.cache.drop_drafts()
        return drafts

    def _catch_up(self, requests: list[Request]) -> dict[int, _Output]:
        """Run each request's pending positions whose next token is known through the head, in one batch;
        {request index: (its last position, normed output, output before the norm)} for the requests whose
        last computed position (the one before the token just sampled) was among them."""
        segments: list[_Segment] = []
        token_ids: list[int] = []
        aux: list[torch.Tensor] = []
        positions: list[int] = []
        owners: list[tuple[int, int]] = []  # (request index, row of its last position) where it can draft
        for index, request in enumerate(requests):
            state = self.states.get(request.request_id)
            if state is None:
                continue
            tokens = request.all_token_ids
            for first, rows in state.pending:
                size = min(rows.shape[0], len(tokens) - 1 - first)  # positions whose next token is known
                if size <= 0:
                    continue
                segments.append(_Segment(state.cache, first, size))
                token_ids += tokens[first + 1 : first + 1 + size]
                aux.append(rows[:size])
                positions += range(first, first + size)
            state.pending = []
            if positions and positions[-1] == len(tokens) - 2 and segments[-1].cache is state.cache:
                owners.append((index, len(positions) - 1))
        if not segments:
            return {}
        embeds = self.embed(torch.tensor(token_ids, device=self.device))
        feature = self.head.fuse(torch.cat(aux).to(embeds.dtype))
        position_tensor = torch.tensor(positions, device=self.device)
        normed, hidden = self.head.layer(embeds, feature, position_tensor, self._attend(segments, commit=True))
        return {index: _Output(positions[row], normed[row], hidden[row]) for index, row in owners}

    @staticmethod
    def _attend(
        segments: list[_Segment], commit: bool
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The head's attention over each segment's request cache, segment by segment in order (a request's
        later positions see its earlier ones)."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            start = 0
            for segment in segments:
                rows = slice(start, start + segment.size)
                outs.append(segment.cache.attend(segment.first, q[rows], k[rows], v[rows], commit))
                start = rows.stop
            return torch.cat(outs)

        return attend
