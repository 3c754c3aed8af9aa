"""Runs one scheduled step: build the batch, run graphs or eager, sample."""

from __future__ import annotations

import logging

import torch

from engine.forward_batch import build_forward_batch
from engine.kv_cache import KVPool
from engine.layers.attention import step_context
from engine.models.llama import LlamaForCausalLM
from engine.sampler import sample
from engine.scheduler import ScheduledStep
from graphs.runner import DecodeGraphRunner

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: KVPool,
        device: torch.device,
        slot_dtype: torch.dtype,
        graph_runner: DecodeGraphRunner | None,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.slot_dtype = slot_dtype
        self.graph_runner = graph_runner
        self.graph_steps = 0
        self.eager_steps = 0

    @torch.no_grad()
    def logits(self, step: ScheduledStep) -> torch.Tensor:
        allocator = self.kv_pool.allocator
        pages = {r.request_id: allocator.pages_of(r.request_id) for r in step.requests}
        batch = build_forward_batch(
            step.requests, step.is_decode, pages, self.kv_pool.page_size, self.device, self.slot_dtype
        )
        if step.is_decode and self.graph_runner is not None and self.graph_runner.can_run(batch.batch_size):
            self.graph_steps += 1
            return self.graph_runner.run(batch.input_ids, batch.positions, batch.meta)
        self.eager_steps += 1
        with step_context(self.model.attention_backend, batch.meta):
            hidden = self.model(batch.input_ids, batch.positions, self.kv_pool.caches, batch.meta)
        if not step.is_decode:
            hidden = hidden[batch.logits_indices]
        return self.model.compute_logits(hidden)

    def run(self, step: ScheduledStep) -> list[int]:
        """Next token of every request in the step."""
        return sample(self.logits(step), step.requests)
