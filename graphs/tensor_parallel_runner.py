"""Rank 0's model runner under tensor parallelism: every step goes to the other ranks first.

The same ModelRunner (graphs/model_runner.py) with two additions, and nothing
changed for world size 1, which keeps the plain class: before a forward, the
step's WireStep goes to every worker (so all ranks run the same forward, graph
replay and collectives); after sampling, the sampled tokens are broadcast so
every rank keeps the same `last_tokens` in its decode rows. Rank 0 samples
alone, from the full logits the LM head gathered: the sampler's state
(penalty rows, seeded generators, grammar masks) lives only here, and one
small broadcast of the tokens is cheaper and simpler than keeping all of it
identical on every rank.

Failures: a collective or a message that fails, or any error inside a
forward (the ranks may then be out of step), becomes the RankGroup's one
RankFailedError naming the rank at fault; the engine stops. A failure of the
sampling alone (a request's bad logits processor, say) is not fatal: rank 0
broadcasts a failed status instead of tokens, the workers keep their rows'
tokens, and the engine re-runs the step in parts to find the request at fault,
as at world size 1 (engine.Engine._isolate_failure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.distributed.channel import Command
from engine.distributed.collectives import broadcast_sampled
from engine.distributed.launcher import RankGroup
from engine.distributed.wire import encode_step
from engine.sampler import SampledTokens, sample
from engine.scheduler import ScheduledStep
from engine.step_message import StepMessage
from engine.transfer import to_device
from graphs.model_runner import ModelRunner


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner at world size > 1 (the module docstring says what it adds)."""

    def __init__(self, *args: Any, ranks: RankGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks

    def forward(self, step: ScheduledStep, message: StepMessage) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A forward without sampling (ModelRunner.logits) on every rank."""
        with self.ranks.step():
            return self._forward_everywhere(step, message, samples=False)

    def _forward_everywhere(
        self, step: ScheduledStep, message: StepMessage, samples: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """samples: rank 0 broadcasts the sampled tokens after this forward (launch)."""
        ranks = self.ranks
        ranks.raise_if_failed()
        assert ranks.channel is not None, "the worker ranks have not joined"
        try:
            lora_slots = self.lora_token_slots(step) if self.lora_rows is not None else None
            ranks.channel.publish(Command.STEP, encode_step(step, message, samples, lora_slots))
            self.received_lora_slots = lora_slots  # the same list fills rank 0's rows: computed once
            return super().forward(step, message)
        except Exception as exc:
            raise ranks.failure(exc) from exc

    @torch.no_grad()
    def launch(
        self, step: ScheduledStep, message: StepMessage, before_sampling: Callable[[], None] | None = None
    ) -> SampledTokens | None:
        with self.ranks.step():
            return self._launch_everywhere(step, message, before_sampling)

    def _launch_everywhere(
        self, step: ScheduledStep, message: StepMessage, before_sampling: Callable[[], None] | None
    ) -> SampledTokens | None:
        logits, rows = self._forward_everywhere(step, message, samples=True)
        if logits is None:
            return None
        state = self.decode_state
        if rows is None or step.is_mixed:
            rows = to_device(message.sample_rows, torch.int64, self.device)
        try:
            if before_sampling is not None:
                before_sampling()
            sampled = sample(logits, step.sampled_requests, state.penalties, rows)
        except BaseException:
            # The workers wait for this step's tokens whatever happened here: they get a failed status and
            # keep their rows' tokens; the engine re-runs the step in parts (or is going down anyway).
            self._broadcast(None, rows)
            raise
        self._broadcast(sampled.token_ids, rows)
        state.record_sampled(rows, sampled.token_ids)
        return sampled

    def _broadcast(self, tokens: torch.Tensor | None, rows: torch.Tensor) -> None:
        try:
            broadcast_sampled(tokens, int(rows.shape[0]), self.device)
        except Exception as exc:
            raise self.ranks.failure(exc) from exc

    def check_ranks(self, engine: Any) -> None:
        """The cross-rank check of the decode state (engine/distributed/consistency.py)."""
        from engine.distributed.consistency import check_ranks_agree, gather_digests

        ranks = self.ranks
        ranks.raise_if_failed()
        assert ranks.channel is not None
        try:
            ranks.channel.publish(Command.CHECK)
            digests = gather_digests(engine)
        except Exception as exc:
            raise ranks.failure(exc) from exc
        check_ranks_agree(digests)
